import sys, time, statistics, numpy as np
from routing_replay.capturer import RoutedExpertsCapturer
L, K, E = 48, 8, 128
n = 1024
cap = RoutedExpertsCapturer(L, K, 8192, 4096, 0, "cpu", num_experts=E)
stream = cap.replay.default_stream
ids = [((np.arange(n, dtype=np.int64)[:, None] * 7919 + l * 131 + np.arange(K) * 17) % E) for l in range(L)]
names = [f"q{r}" for r in range(n)]
grow, steady = [], []
for step in range(300):
    for l in range(L):
        cap.capture(l, ids[l])
    positions = np.full(n, step, dtype=np.int64)
    stream.synchronize(); time.sleep(0.0005)
    t0 = time.perf_counter(); cap.sync_fwd_experts_buffer_DtoH(positions, dict.fromkeys(names, 1)); dt = (time.perf_counter() - t0) * 1e6
    (grow if step in (0, 16, 32, 64, 128, 256) else steady).append(round(dt))
print("growth steps us", grow, "steady median", round(statistics.median(steady), 1))
