"""The CUDA-event timer the PyTorch-side benchmark scripts share (the C++ side is gpu_timing.h)."""
import statistics


def median_ms(fn, runs, warmup=5):
    """Median milliseconds of `runs` timed calls of fn after `warmup` untimed ones, timed with CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)
