import sys, time, statistics, numpy as np
from routing_replay.capturer import RoutedExpertsCapturer
L, K, E = 48, 8, 128
cap = RoutedExpertsCapturer(L, K, 8192, 4096, 0, "cpu", num_experts=E)
def busy(us):
    t = time.perf_counter() + us * 1e-6
    while time.perf_counter() < t: pass
for n in (64, 1024):
    ids = [((np.arange(n, dtype=np.int64)[:, None] * 7919 + l * 131 + np.arange(K) * 17) % E) for l in range(L)]
    for gap in (0, 20, 54):
        ts = []
        for step in range(60):
            for l in range(L):
                busy(gap)
                t0 = time.perf_counter(); cap.capture(l, ids[l]); ts.append(time.perf_counter() - t0)
            cap.replay.default_stream.synchronize() if hasattr(cap.replay, "default_stream") else None
            cap.reset_device_buffer()
        dst = np.empty_like(ids[0]); t0 = time.perf_counter()
        for i in range(1000): np.copyto(dst, ids[i % L])
        cp = (time.perf_counter() - t0) / 1000 * 1e6
        print(n, "gap", gap, "capture median us", round(statistics.median(ts) * 1e6, 2), "np.copyto", round(cp, 2))
