"""--lora adapters: one step mixing four adapters against the base alone, in process.

    PYTHONPATH=. python benchmarks/lora.py [--shape minilm|bge-base] [--device cpu|cuda] [--repeats 5] [--rank 16]
        [--sequences 32] [--tokens 128] [--targets all|query-value]

Serves the bundled all-MiniLM-L6-v2 (6 layers, hidden 384), or a random model of bge-base's shape (12 layers,
hidden 768), with four random PEFT adapters of rank `--rank`
on q/k/v, the attention output and both MLP linears (every linear; `--targets query-value`: PEFT's default for
BERT, query and value only), and times the model runner's step (the
forward pass and the pooling head) over `--sequences` sequences of `--tokens` tokens: all on the base, all
on one adapter, and the four adapters mixed in one step (sequence i runs adapter i % 4). Target: the mixed
step at >= 0.8x the base's tokens per second. Best of `--repeats` after a warm-up step. Prints markdown.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from embedserv.config import ModelConfig, bundled_model_path
from embedserv.engine.served_model import read_served_model
from embedserv.steps import OutputKind, ScheduledSequence, StepBatch
from embedserv.worker.replica import build_runner

# Every linear (the default), or PEFT's own default for BERT models (query and value: what LoraConfig()
# targets when target_modules is left out).
TARGETS = {
    "all": ["query", "key", "value", "output.dense", "intermediate.dense"],
    "query-value": ["query", "value"],
}
ADAPTERS = 4


def bge_base_shaped(root: Path) -> Path:
    """A random-weight BERT of bge-base-en-v1.5's shape (12 layers, hidden 768, MLP 3072), with MiniLM's
    tokenizer, as a transformers directory (the runner pools by CLS, as bge does)."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(str(bundled_model_path()))
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=512,
    )
    out = root / "bge-base-shaped"
    BertModel(config).eval().save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def build_adapters(model_dir: Path, root: Path, rank: int, targets: str = "all") -> tuple[tuple[str, str], ...]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    adapters = []
    for index in range(ADAPTERS):
        torch.manual_seed(index)
        model = get_peft_model(
            AutoModel.from_pretrained(str(model_dir)),
            LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS[targets]),
        )
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0.0, 0.02)
        out = root / f"adapter{index}"
        model.save_pretrained(str(out), safe_serialization=True)
        adapters.append((f"a{index}", str(out)))
    return tuple(adapters)


def step(num_sequences: int, tokens: int, adapter_of) -> StepBatch:
    ids = tuple(range(1000, 1000 + tokens))
    return StepBatch(
        tuple(
            ScheduledSequence(request_id=i, token_ids=ids, output=OutputKind.POOL, adapter=adapter_of(i))
            for i in range(num_sequences)
        )
    )


def best_seconds(cases: dict, batches: dict, repeats: int) -> dict[str, float]:
    """Each case's best time; the cases take turns, so that load from other processes (a shared CPU) falls on
    all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for name, (runner, _) in cases.items():
        runner.execute(batches[name])
    for _ in range(repeats):
        for name, (runner, _) in cases.items():
            start = time.perf_counter()
            runner.execute(batches[name])
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: min(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--targets",
        choices=tuple(TARGETS),
        default="all",
        help="every linear, or query and value only (PEFT's default for BERT)",
    )
    parser.add_argument(
        "--shape",
        choices=("minilm", "bge-base"),
        default="minilm",
        help="the bundled all-MiniLM-L6-v2, or a random model of bge-base-en-v1.5's shape",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bundled_model_path() if args.shape == "minilm" else bge_base_shaped(Path(tmp))
        lora = build_adapters(model_dir, Path(tmp), args.rank, args.targets)
        config = ModelConfig(path=str(model_dir), served_name="m", device=args.device, dtype="float32", lora=lora)
        runner = build_runner(config, read_served_model(config).spec)
        plain = build_runner(replace(config, lora=()), read_served_model(replace(config, lora=())).spec)
    cases = {
        "no --lora (plain model)": (plain, lambda i: -1),
        "--lora, base rows only": (runner, lambda i: -1),
        "--lora, one adapter": (runner, lambda i: 0),
        f"--lora, {ADAPTERS} adapters mixed": (runner, lambda i: i % ADAPTERS),
    }
    num_tokens = args.sequences * args.tokens
    where = "every linear" if args.targets == "all" else "query and value"
    print(
        f"{args.shape}, {args.device}, float32, {args.sequences} x {args.tokens} tokens per step, "
        f"rank {args.rank} on {where}, best of {args.repeats}\n"
    )
    print("| step | ms | tokens/s | x base |")
    print("|---|---:|---:|---:|")
    batches = {name: step(args.sequences, args.tokens, adapter_of) for name, (_, adapter_of) in cases.items()}
    best = best_seconds(cases, batches, args.repeats)
    base = next(iter(best.values()))
    for name, seconds in best.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {num_tokens / seconds:,.0f} | {base / seconds:.2f} |")


if __name__ == "__main__":
    main()
