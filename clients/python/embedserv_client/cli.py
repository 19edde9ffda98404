"""`embedserv-client`: call a server from the shell; every command prints JSON on stdout.

    embedserv-client embed "a sentence" "another"
    embedserv-client embed "a photo of a cat" --image cat.png --image page.jpg
    embedserv-client --target dns:///embedserv-headless.default.svc.cluster.local:50051 health

Exit status: 0 done (health: SERVING), 1 the call failed (or health is not SERVING), 2 bad usage, 141 stdout was
closed before all was printed (`| head`), quietly, as a shell reports a command its SIGPIPE ended."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from typing import cast

import numpy as np

from embedserv_client.client import Client
from embedserv_client.late_chunks import TextChunks
from embedserv_client.options import Tls
from embedserv_client.plans import ENCODINGS
from embedserv_client.types import Classification, EmbedOutputs, EmbedservError, Token

# 128 + SIGPIPE (13 on every POSIX system; Windows has no SIGPIPE).
CLOSED_PIPE = 128 + getattr(signal, "SIGPIPE", 13)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="embedserv-client", description="Call an embedserv server; prints JSON.")
    p.add_argument(
        "--target",
        default=os.environ.get("EMBEDSERV_TARGET", "127.0.0.1:50051"),
        help="host:port or dns:///name:port (default: env EMBEDSERV_TARGET, else 127.0.0.1:50051)",
    )
    p.add_argument("--api-key", default=os.environ.get("EMBEDSERV_API_KEY"), help="default: env EMBEDSERV_API_KEY")
    p.add_argument("--priority", type=int, help="the calls' priority, higher runs sooner (default: the server's)")
    p.add_argument("--tls", action="store_true", help="TLS with the system's roots (or --tls-ca)")
    p.add_argument("--tls-ca", metavar="PEM", help="CA certificate that signed the server's (implies --tls)")
    p.add_argument("--tls-cert", metavar="PEM", help="client certificate for mutual TLS (with --tls-key)")
    p.add_argument("--tls-key", metavar="PEM", help="client private key")
    p.add_argument("--model", default="", help="served model name (default: the server's first)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per command, retries included")
    commands = p.add_subparsers(dest="command", required=True)

    _add_embed(commands)
    _add_embed_chunks(commands)

    sparse = commands.add_parser("embed-sparse", help="sparse vectors: {indices, values} per text")
    sparse.add_argument("texts", nargs="+", metavar="TEXT")
    sparse.add_argument("--top-k", type=int, help="keep each text's largest values")
    sparse.add_argument("--truncate", action=argparse.BooleanOptionalAction)

    multi = commands.add_parser("embed-multi-vector", help="token vectors: a [num_vectors, dim] list per text")
    multi.add_argument("texts", nargs="*", metavar="TEXT")
    multi.add_argument(
        "--image",
        dest="images",
        action="append",
        default=[],
        metavar="FILE",
        help="a page image file, its vectors after the texts' (repeat it)",
    )
    multi.add_argument("--prompt-name", help='"query" or "document" for late-interaction models')
    multi.add_argument("--truncate", action=argparse.BooleanOptionalAction)

    rerank = commands.add_parser("rerank", help="score documents against a query, best first")
    rerank.add_argument("query")
    rerank.add_argument("documents", nargs="*", metavar="DOCUMENT")
    rerank.add_argument(
        "--document-image",
        dest="document_images",
        action="append",
        default=[],
        metavar="FILE",
        help="a page image file as a document, instead of DOCUMENTs (repeat it)",
    )
    rerank.add_argument("--top-n", type=int)
    rerank.add_argument("--truncate", action=argparse.BooleanOptionalAction)
    rerank.add_argument("--chunking", choices=["max"], help="score a too-long document by its best window")

    classify = commands.add_parser("classify", help="label texts")
    classify.add_argument("texts", nargs="+", metavar="TEXT")
    classify.add_argument("--truncate", action=argparse.BooleanOptionalAction)
    classify.add_argument(
        "--label",
        dest="candidate_labels",
        action="append",
        default=[],
        help="a candidate label for zero-shot classification with an NLI model (repeat it)",
    )
    classify.add_argument("--hypothesis-template", default="", help='default: "This example is {}."')
    classify.add_argument("--multi-label", action="store_true", help="score each --label on its own")

    generate = commands.add_parser("generate", help="generate text from a prompt")
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", default=[])
    generate.add_argument("--decoder-prompt", default="", help="encoder-decoder models: the decoder's start")

    tokenize = commands.add_parser("tokenize", help="tokens as the model sees them")
    tokenize.add_argument("texts", nargs="+", metavar="TEXT")

    commands.add_parser("models", help="the served models and the server's limits")
    health = commands.add_parser("health", help="exit 0 when SERVING")
    health.add_argument("--service", default="", help="a model name; default: the whole server")
    return p  # fmt: skip


def _add_embed(commands) -> None:
    embed = commands.add_parser("embed", help="embed texts and images (no TEXT nor --image: a text per line of stdin)")
    embed.add_argument("texts", nargs="*", metavar="TEXT")
    embed.add_argument(
        "--image",
        dest="images",
        action="append",
        default=[],
        metavar="FILE",
        help="an image file (PNG, JPEG, WebP) to embed after the texts (repeat it)",
    )
    embed.add_argument("--dimensions", type=int)
    embed.add_argument("--no-normalize", action="store_true")
    embed.add_argument("--truncate", action=argparse.BooleanOptionalAction)
    embed.add_argument("--prompt-name")
    embed.add_argument("--task", help="the model's task adapter (ListModels' adapters), e.g. retrieval.query")
    embed.add_argument(
        "--encoding",
        default="float32",
        choices=list(ENCODINGS),
        help="default: float32; int8 / uint8 also print the encoding_scale that decodes them",
    )
    embed.add_argument("--chunking", choices=["mean"], help="embed inputs past the model's limit by windows")
    embed.add_argument(
        "--bypass-cache",
        action="store_true",
        help="neither read nor fill the server's embedding cache (--embedding-cache)",
    )


def _add_embed_chunks(commands) -> None:
    chunked = commands.add_parser("embed-chunks", help="late chunking: a vector per sentence or token window")
    chunked.add_argument("texts", nargs="+", metavar="TEXT")
    chunked.add_argument("--splitter", default="sentences", choices=["sentences", "tokens"], help="default: sentences")
    chunked.add_argument("--chunk-tokens", type=int, default=0, help="tokens: tokens per chunk")
    chunked.add_argument("--overlap-tokens", type=int, default=0, help="tokens: tokens neighbouring chunks share")
    chunked.add_argument("--dimensions", type=int)
    chunked.add_argument("--prompt-name")


class UnreadableFile(ValueError):
    """A file named on the command line that cannot be read (bad usage: exit 2)."""


def _read_images(paths: list[str], flag: str) -> list[bytes]:
    """Each file's bytes, read before any call, so a wrong path is named before the server is asked."""
    images = []
    for path in paths:
        try:
            with open(path, "rb") as file:
                images.append(file.read())
        except OSError as exc:
            raise UnreadableFile(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    return images


def _asdict(value: object) -> dict | None:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else None


def _tls(args: argparse.Namespace) -> bool | Tls:
    if args.tls_ca or args.tls_cert or args.tls_key:
        return Tls(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)
    return args.tls


def _run(client: Client, args: argparse.Namespace) -> tuple[dict, int]:
    if args.command == "embed":
        images = _read_images(args.images, "--image")
        texts = args.texts or ([] if images else [line.rstrip("\n") for line in sys.stdin if line.strip()])
        result = client.embed(
            texts,
            images=images or None,
            normalize=False if args.no_normalize else None,
            truncate=args.truncate,
            dimensions=args.dimensions,
            prompt_name=args.prompt_name,
            encoding=args.encoding,
            outputs=["dense"],
            chunking=args.chunking,
            task=args.task,
            bypass_cache=args.bypass_cache,
        )
        outputs = cast(EmbedOutputs, result)  # outputs= was given
        scale = {"encoding_scale": outputs.encoding_scale} if outputs.encoding_scale else {}
        return {"embeddings": np.asarray(outputs.dense).tolist(), **scale}, 0
    if args.command == "embed-chunks":
        found = client.embed_chunks(
            args.texts,
            splitter=args.splitter,
            chunk_tokens=args.chunk_tokens,
            overlap_tokens=args.overlap_tokens,
            dimensions=args.dimensions,
            prompt_name=args.prompt_name,
        )
        inputs = [
            {
                "chunks": [
                    {"start": s, "end": e, "embedding": v.tolist()}
                    for (s, e), v in zip(c.spans, c.vectors, strict=True)
                ]
            }
            for c in cast(list[TextChunks], found)  # a list of texts gives a list
        ]
        return {"inputs": inputs}, 0
    if args.command == "embed-sparse":
        vectors = client.embed_sparse(args.texts, top_k=args.top_k, truncate=args.truncate)
        return {"embeddings": [{"indices": i.tolist(), "values": v.tolist()} for i, v in vectors]}, 0
    if args.command in ("embed-multi-vector", "rerank"):
        return _page_images_call(client, args), 0
    if args.command == "classify":
        classifications = client.classify(
            args.texts,
            truncate=args.truncate,
            candidate_labels=args.candidate_labels,
            hypothesis_template=args.hypothesis_template,
            multi_label=args.multi_label,
        )
        found_classes = cast(list[Classification], classifications)  # a list of texts gives a list
        return {"classifications": [dataclasses.asdict(c) for c in found_classes]}, 0
    if args.command == "generate":
        stream = client.generate(
            args.prompt,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            stop=args.stop,
            decoder_prompt=args.decoder_prompt,
        )
        text = stream.text()
        return {"text": text, "finish_reason": stream.finish_reason, "usage": _asdict(stream.usage)}, 0
    if args.command == "tokenize":
        tokenized = client.tokenize(args.texts)
        per_text = cast(list[list[Token]], tokenized)  # a list of texts gives a list
        return {"inputs": [[dataclasses.asdict(t) for t in tokens] for tokens in per_text]}, 0
    if args.command == "models":
        models = [dataclasses.asdict(m) for m in client.models()]
        return {"models": models, "limits": dataclasses.asdict(client.limits())}, 0
    status = client.health(args.service)
    return {"status": status}, 0 if status == "SERVING" else 1


def _page_images_call(client: Client, args: argparse.Namespace) -> dict:
    """embed-multi-vector and rerank, whose inputs may be page images (--image, --document-image)."""
    if args.command == "embed-multi-vector":
        images = _read_images(args.images, "--image") or None
        arrays = client.embed_multi_vector(
            args.texts, images=images, prompt_name=args.prompt_name, truncate=args.truncate
        )
        return {"embeddings": [a.tolist() for a in arrays]}
    images = _read_images(args.document_images, "--document-image") or None
    results = client.rerank(
        args.query,
        args.documents,
        document_images=images,
        top_n=args.top_n,
        truncate=args.truncate,
        chunking=args.chunking,
    )
    named = args.documents or args.document_images
    return {"results": [dataclasses.asdict(r) | {"document": named[r.index]} for r in results]}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        tls = _tls(args)
    except ValueError as err:
        print(f"embedserv-client: {err}", file=sys.stderr)
        return 2
    try:
        with Client(
            args.target, args.api_key, tls, model=args.model, timeout=args.timeout, priority=args.priority
        ) as client:
            result, code = _run(client, args)
    except EmbedservError as err:
        print(f"embedserv-client: {err}", file=sys.stderr)
        return 1
    except (OSError, UnreadableFile) as err:  # an unreadable --tls-* or image file
        print(f"embedserv-client: {err}", file=sys.stderr)
        return 2
    return code if _printed(result) else CLOSED_PIPE


def _printed(result: dict) -> bool:
    """Prints the result; False when the reader of stdout has gone (`| head -c 50`)."""
    try:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # Python's docs on SIGPIPE: point stdout at devnull, or the flush at exit raises (and prints) again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
