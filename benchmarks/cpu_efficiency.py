"""How close the CPU engine comes to this machine's own matmul rate, and where the rest of the time goes.

    python benchmarks/cpu_efficiency.py [--model DIR] [--texts 1000] [--repeats 2] [--precisions float32,int8]
        [--attention sdpa,cpu_varlen] [--budgets 1024,2048,4096,8192] [--budget-precision float32]

1. The machine's rate for the model's linear shapes: each distinct (in, out) shape of the model's
   linears at 4096 rows, oneDNN packed float32 (bfloat16 where native), and our int8 path.
2. The engine in this process on real texts (stdlib docstrings, mixed lengths, truncated): tokens/s, and
   the linears' FLOPs it achieved as a share of (1) -- the efficiency the issue sets targets for.
3. A profile of those runs by operator: linears, attention, the rest.
4. The same number of tokens in texts of one length (one attention call per batch) against the real mix
   (one call per run of equal lengths): what the distinct lengths cost.
5. The token budget per forward pass (cpu_isa.py's constant for this ISA class).
Prints markdown for docs/performance-history.md, with the CPU's ISA.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.attention_kernels import best_us
from benchmarks.corpus import stdlib_texts
from benchmarks.precisions import options as precision_options
from embedserv import cpu_isa
from embedserv.config import ModelConfig, bundled_model_path
from embedserv.engine.sync import SyncEngine
from embedserv.models.int8 import Int8Weight
from embedserv.models.layers import Linear
from embedserv.types import EmbedParams

ROWS = 4096
OPERATOR_GROUPS = {
    "linears": ("mkldnn::_linear_pointwise", "onednn::qlinear_pointwise", "aten::linear", "aten::addmm"),
    "attention": (
        "embedserv_cpu_varlen::attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::scaled_dot_product_attention",
        "aten::bmm",
        "aten::_softmax",
    ),
    # int8's per-token quantize and dequantize steps: eager passes, or inductor's compiled graphs.
    "int8 steps": ("aten::addcmul", "aten::amin", "aten::amax", "aten::addmm_"),
}
COMPILED_GRAPH = "## Call CompiledFxGraph"  # how the profiler names a call of an inductor graph (int8's steps)


def best_seconds(run, repeats: int) -> float:
    return best_us(run, repeats) / 1e6


def linear_shapes(engine: SyncEngine) -> collections.Counter:
    model = engine.core.workers[0].runner.model
    return collections.Counter((m.in_features, m.out_features) for m in model.modules() if isinstance(m, Linear))


def matmul_rates(shapes: collections.Counter, repeats: int) -> dict[str, float]:
    """GFLOP/s over the model's linears at ROWS rows, each shape weighted by how often the model has it."""
    kinds = {"float32": torch.float32, "int8": None}
    if cpu_isa.detect().native_bf16:
        kinds["bfloat16"] = torch.bfloat16
    rates = {}
    for kind, dtype in kinds.items():
        flops = seconds = 0.0
        for (k, n), count in shapes.items():
            weight, x = torch.randn(n, k) * 0.05, torch.randn(ROWS, k)
            if dtype is None:
                int8 = Int8Weight(weight, None, *cpu_isa.int8_levels())
                run = lambda int8=int8, x=x: int8.matmul(x)  # noqa: E731
            else:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype))
                x = x.to(dtype)
                run = lambda p=packed, x=x: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")  # noqa: E731
            seconds += count * best_seconds(run, repeats + 3)
            flops += count * 2 * ROWS * k * n
        rates[kind] = flops / seconds / 1e9
    return rates


def run_engine(model: str, texts: list[str], repeats: int, **options) -> tuple[float, int, SyncEngine]:
    config = ModelConfig(path=model, served_name="bench", **options)
    engine = SyncEngine(config)
    engine.__enter__()
    params = EmbedParams(truncate=True)
    calls = [texts[i : i + 32] for i in range(0, len(texts), 32)]
    tokens = sum(r.prompt_tokens for r in engine.embed_concurrently(calls, params))
    seconds = best_seconds(lambda: engine.embed_concurrently(calls, params), repeats)
    return seconds, tokens, engine


def profile(engine: SyncEngine, texts: list[str]) -> tuple[dict[str, float], dict[str, float]]:
    """Shares of the model thread's time: by group (linears, attention, other ops) and by operator."""
    calls = [texts[i : i + 32] for i in range(0, len(texts), 32)]
    # The profiler records the thread it is started on: the in-process worker's model thread.
    model_thread = engine.core.workers[0]._model_thread
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    model_thread.submit(prof.__enter__).result()
    engine.embed_concurrently(calls, EmbedParams(truncate=True))
    model_thread.submit(prof.__exit__, None, None, None).result()
    totals, operators = collections.Counter(), collections.Counter()
    for event in prof.key_averages():
        group = next((g for g, names in OPERATOR_GROUPS.items() if event.key in names), None)
        if event.key.startswith(COMPILED_GRAPH):
            group = "int8 steps"
        totals[group or "other ops"] += event.self_cpu_time_total
        operators[event.key] += event.self_cpu_time_total
    whole = sum(totals.values())
    return (
        {group: value / whole for group, value in totals.items()},
        {name: value / whole for name, value in operators.most_common()},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(bundled_model_path()))
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--precisions", default="float32,int8", help="as benchmarks/precisions.py takes them")
    parser.add_argument("--budgets", default="1024,2048,4096,8192", help="token budgets to sweep; empty: none")
    parser.add_argument("--budget-precision", default="float32", help="the precision the budgets are swept at")
    parser.add_argument(
        "--attention", default="", help="attention backends to compare, each with every precision; empty: the default"
    )
    parser.add_argument("--ops", type=int, default=12, help="operators in the per-op profile of each precision")
    args = parser.parse_args()
    texts = stdlib_texts(args.texts)
    print(
        f"# {cpu_isa.detect().summary()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{len(texts)} texts, best of {args.repeats}"
    )

    rows, shapes, linear_flops = [], None, 0
    backends = args.attention.split(",") if args.attention else [None]
    for precision, backend in ((p, b) for p in args.precisions.split(",") for b in backends):
        options = precision_options(precision)  # int8[:ACTIVATIONS[:FUSION]] as benchmarks/precisions.py takes it
        if backend:
            options["attention_backend"] = backend
        seconds, tokens, engine = run_engine(args.model, texts, args.repeats, **options)
        if shapes is None:
            shapes = linear_shapes(engine)
            linear_flops = sum(count * 2 * k * n for (k, n), count in shapes.items())
        groups, operators = profile(engine, texts)
        engine.__exit__(None, None, None)
        label = f"{precision} ({backend or engine.core.workers[0].runner.backend.name})"
        rows.append((precision, label, tokens / seconds, groups, operators))
    rates = matmul_rates(shapes, args.repeats)

    print(
        "\n| precision | tokens/s | linears' GFLOP/s | machine's rate, same shapes | share | time in linears "
        "| attention | int8 steps | other |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for precision, label, rate, groups, _ in rows:
        achieved = rate * linear_flops / 1e9
        machine = rates.get("int8" if precision.startswith("int8") else precision)
        share = f"{achieved / machine:.0%}" if machine else "n/a"
        print(
            f"| {label} | {rate:.0f} | {achieved:.1f} | {machine or float('nan'):.1f} | {share} "
            f"| {groups.get('linears', 0):.0%} | {groups.get('attention', 0):.0%} | {groups.get('int8 steps', 0):.0%} "
            f"| {groups.get('other ops', 0):.0%} |"
        )

    for _, label, _, _, operators in rows:
        print(f"\n| {label}: operator | share of the model thread |")
        print("|---|---:|")
        for name, share in list(operators.items())[: args.ops]:
            print(f"| `{name}` | {share:.1%} |")

    mean_words = max(1, sum(len(t.split()) for t in texts) // len(texts))
    uniform = ["word " * mean_words] * len(texts)
    print("\n| float32 input | tokens | tokens/s |")
    print("|---|---:|---:|")
    for name, batch in (("real mix of lengths", texts), (f"one length ({mean_words} words each)", uniform)):
        seconds, tokens, engine = run_engine(args.model, batch, args.repeats)
        engine.__exit__(None, None, None)
        print(f"| {name} | {tokens} | {tokens / seconds:.0f} |")

    print(f"\n| {args.budget_precision} --max-batch-tokens | tokens/s |")
    print("|---:|---:|")
    for budget in filter(None, args.budgets.split(",")):
        options = precision_options(args.budget_precision) | {"max_batch_tokens": int(budget)}
        seconds, tokens, engine = run_engine(args.model, texts, args.repeats, **options)
        engine.__exit__(None, None, None)
        print(
            f"| {budget}{' (default here)' if int(budget) == cpu_isa.cpu_batch_tokens() else ''} "
            f"| {tokens / seconds:.0f} |"
        )


if __name__ == "__main__":
    main()
