"""Where a process's first speculative call gets its extra allocated memory (README Status): the
allocator's count before and after the first matrix product on the default stream, on a side
stream (as graph warm-ups run) and inside a graph capture. cuBLAS takes a workspace per stream
from PyTorch's caching allocator, which ``max_memory_allocated`` counts.

    python benchmarks/diagnose_first_call_memory.py
"""
import torch


def main():
    a = torch.randn(64, 576, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1536, 576, device="cuda", dtype=torch.bfloat16)

    def mib():
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() / 2**20

    rows = [("start", mib())]
    torch.nn.functional.linear(a, w)
    rows.append(("after the first matmul, default stream", mib()))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.nn.functional.linear(a, w)
    rows.append(("after a matmul on a side stream", mib()))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        torch.nn.functional.linear(a, w)
    rows.append(("after capturing one on that stream", mib()))
    other = torch.cuda.Stream()
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2, stream=other):
        torch.nn.functional.linear(a, w)
    rows.append(("after capturing one on a third stream", mib()))
    for name, value in rows:
        print(f"{name:<45} {value:8.1f} MiB allocated")
    print(f"{'peak':<45} {torch.cuda.max_memory_allocated() / 2**20:8.1f} MiB")


if __name__ == "__main__":
    main()
