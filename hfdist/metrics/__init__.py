"""Measurements and the formulas they are compared with.

    flops.py   training FLOPs per token (any registered architecture), TFLOP/s, MFU
    peaks.py   device peak FLOP/s: datasheet table per GPU, measured matmul peak on CPU
    memory.py  bytes a rank holds (local shards, DeepSpeed partitions), peak memory readers
    bubble.py  a pipeline schedule's measured bubble next to (p-1)/(m+p-1)
    timing.py  seconds a short operation takes: the best of windows of back-to-back calls (CUDA events on a GPU)
"""
