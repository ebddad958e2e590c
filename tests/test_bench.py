"""tools/bench.py must keep running (a smoke run; speed itself is measured by the bench, never asserted here) and count
a step's work right, and the optional --compile path of train.py must train exactly like eager mode."""

import json
import os
import subprocess
import sys

from conftest import MICRO, ROOT, losses, run


def test_bench_smoke(mirror):
    proc = subprocess.run([sys.executable, "-m", "tools.bench", "--smoke"], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PREPROJ_MIRROR=mirror))
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert {line.split("|")[1].strip() for line in table} == {"1", "2", "3", "4", "5", "6"}
    assert "bfloat16, ours vs transformers" in proc.stdout and "decisions flipped" in proc.stdout
    assert "K/V cache bytes" in proc.stdout and "| 1.000 |  | == 1.0 | pass |" in proc.stdout
    assert "malloc: freed memory kept" in proc.stdout.splitlines()[0]
    assert "bf16, model.attention vs fused kernel" in proc.stdout
    assert "if only its matrix products ran (their ceiling)" in proc.stdout
    assert "if only its matrix products ran on its operands' layouts" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "tools.bench", "--smoke", "--sections", "5"], cwd=ROOT,
                          capture_output=True, text=True, env=dict(os.environ, PREPROJ_MIRROR=mirror))
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert table and {line.split("|")[1].strip() for line in table} == {"5"}


def test_compile_matches_eager(micro_base, tmp_path):
    common = f"--init_from {micro_base} --preproj --skip {MICRO} --max_iters 3"
    run(f"{common} --out_dir {tmp_path / 'eager'}")
    run(f"{common} --out_dir {tmp_path / 'compiled'} --compile")
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert max(abs(a - b) for a, b in zip(eager, compiled)) < 1e-4, (eager, compiled)
    assert json.loads((tmp_path / "compiled" / "config.json").read_text())["kind"] == "probe"


def test_step_flops_counts_the_products_the_step_runs():
    """Section 6's achieved rate divides the FLOPs of the products a step runs (step_flops), held here to a count by
    hand and to the profiler's record of the products. Pre-training runs three forwards' worth. A probe on a frozen
    base runs its forward, the input gradient of every product with a weight and both of attention's (their operands
    are both activations), and the new weights' gradients, less what leads only to the frozen embedding: the first
    block's MLP and its W_up's input gradient. train_flops, an estimate, counts those too, and biases and norms as
    weights."""
    import torch

    from model import GPT
    from tools.bench import recorded_products, shape_config, step_flops, step_fn, train_flops
    T = 32
    for probe in (False, True):
        torch.manual_seed(0)
        c = shape_config("tiny", switches=probe)
        model = GPT(c)
        if probe:
            model.freeze_base()
        x = torch.randint(0, c.vocab_size, (1, T + 1))
        step = step_fn(model, False, x, torch.bfloat16)
        d, f, e, L = c.n_embd, c.intermediate_size, c.preproj_dim, c.n_layer
        base = 2 * T * (L * (3 * d * d + d * d + 2 * d * f) + d * c.vocab_size)  # forward products with base weights
        attn = 4 * L * d * T * T  # forward: scores and values
        vectors = 2 * T * sum(p.numel() for p in model.parameters() if p.ndim == 1)  # biases and norms
        if probe:
            new = 2 * T * L * (2 * d * e + d * d)  # W_up, W_down, W_skip: forward
            skipped = 2 * T * (2 * d * f + d * e)
            expected = (base + new + attn) + (base + new + 2 * attn) + new - skipped
            assert train_flops(c, T, frozen_base=True) == expected + skipped + 2 * vectors
        else:
            expected = 3 * (base + attn)
            assert train_flops(c, T, frozen_base=False) == expected + 3 * vectors
        assert step_flops(step) == expected
        # fp32 runs the fused attention kernel, whose backward computes the scores again, and the loss's in-place
        # weight-gradient product
        assert step_flops(step_fn(model, False, x)) == expected + attn // 2
        assert sum(2 * a.numel() * b.shape[-1] for a, b in recorded_products(step, "cpu")) == expected


def test_matmul_replay_records_every_kind_of_product():
    """The ceiling row replays every matrix product a step runs, the forms with an added term included, on operands
    of the recorded shapes; an operation that is not a product is left out."""
    import torch

    from tools.bench import matmul_replay
    a, b, m, w = torch.randn(2, 3, 4), torch.randn(2, 4, 5), torch.randn(3, 4), torch.randn(4, 5)

    def step():
        return [torch.baddbmm(torch.zeros(3, 5), a, b), a @ b, torch.addmm(torch.zeros(5), m, w), m @ m.T,
                torch.softmax(m, -1)]
    shapes = [tuple(out.shape) for out in matmul_replay(step, "cpu")()]
    assert shapes == [(2, 3, 5), (2, 3, 5), (3, 5), (3, 3)]


def test_matmul_replay_keeps_the_recorded_layouts_when_asked():
    """The row of the products as the step lays them out replays a transposed operand transposed, and a view into
    a wider tensor with its stride; the ceiling row replays both contiguous."""
    import torch

    from tools.bench import recorded_products
    g, x, wide = torch.randn(6, 3), torch.randn(6, 4), torch.randn(2, 5, 12)

    def step():  # the second product runs as one mm of the 10 rows, each 12 apart
        return [g.T @ x, wide[..., :4] @ torch.randn(4, 2)]

    def strides(keep_strides):
        return [operand.stride() for pair in recorded_products(step, "cpu", keep_strides) for operand in pair]
    assert strides(keep_strides=True) == [(1, 3), (4, 1), (12, 1), (2, 1)]
    assert strides(keep_strides=False) == [(6, 1), (4, 1), (4, 1), (2, 1)]


def test_preloaded_malloc_is_read_from_the_mapped_libraries():
    """The bench's first line names the allocator it ran on: a tcmalloc or jemalloc preloaded in glibc's place is
    found among the process's mapped libraries; glibc alone names none."""
    from lab.cli import preloaded_malloc
    line = "7f3c2a000000-7f3c2a022000 r--p 00000000 08:01 1835 {}\n"
    glibc = line.format("/usr/lib/x86_64-linux-gnu/libc.so.6")
    assert preloaded_malloc(glibc) is None
    assert preloaded_malloc(glibc + line.format("/usr/lib/libtcmalloc_minimal.so.4.5.10")) == "tcmalloc"
    assert preloaded_malloc(line.format("/opt/lib/libjemalloc.so.2") + glibc) == "jemalloc"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    proc = subprocess.run([sys.executable, "-c", "from lab.cli import preloaded_malloc; print(preloaded_malloc())"],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.stdout.strip() == "None", proc.stderr[-2000:]  # this process's own maps, read for real
