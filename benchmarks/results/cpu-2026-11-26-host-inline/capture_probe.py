import sys, time, statistics, numpy as np
from routing_replay.capturer import RoutedExpertsCapturer
L, K, E = 48, 8, 128
cap = RoutedExpertsCapturer(L, K, 8192, 4096, 0, "cpu", num_experts=E)
rep = cap.replay; nat = cap._native
def busy(us):
    t = time.perf_counter() + us * 1e-6
    while time.perf_counter() < t: pass
stream = rep._current_stream()
for n in (1, 256, 512, 1024):
    ids = [((np.arange(n, dtype=np.int64)[:, None] * 7919 + l * 131 + np.arange(K) * 17) % E) for l in range(L)]
    for gap in (100,):
        ts, tn, tc = [], [], []
        dst = np.empty_like(ids[0])
        for step in range(40):
            for l in range(L):
                busy(gap)
                x = ids[l] + 0  # fresh array, as a forward makes
                t0 = time.perf_counter(); cap.capture(l, x); ts.append(time.perf_counter() - t0)
            for l in range(L):
                busy(gap)
                x = ids[l] + 0
                t0 = time.perf_counter(); nat.capture_array(l, x, stream, True); tn.append(time.perf_counter() - t0)
            for l in range(L):
                busy(gap)
                x = ids[l] + 0
                t0 = time.perf_counter(); np.copyto(dst, x); tc.append(time.perf_counter() - t0)
            rep.default_stream.synchronize() if hasattr(rep, "default_stream") else None
            cap.reset_device_buffer()
        m = lambda v: round(statistics.median(v) * 1e6, 2)
        print(n, "gap", gap, "capture", m(ts), "native capture_array", m(tn), "np.copyto fresh", m(tc))
