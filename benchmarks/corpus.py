"""Real texts of varied length, built at run time from the Python standard library's docstrings.

Used by the tests (parity on real text) and by the benchmarks (throughput on a realistic length mix).
Nothing is downloaded: the texts are module, class, function and method docstrings of a fixed list of
stdlib modules, plus their first lines as short texts. The result depends only on the Python build and
the seed, so two runs on the same interpreter return the same list.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import random
import warnings

# Imported for their docstrings only: no side effects on import, present on every CPython build.
MODULES = (
    "abc",
    "argparse",
    "ast",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "cmd",
    "codecs",
    "collections",
    "concurrent.futures",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "email",
    "email.message",
    "enum",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "html.parser",
    "http.client",
    "http.server",
    "imaplib",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "json.decoder",
    "json.encoder",
    "logging",
    "logging.handlers",
    "mailbox",
    "math",
    "mimetypes",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "pickletools",
    "platform",
    "plistlib",
    "pprint",
    "queue",
    "quopri",
    "random",
    "re",
    "sched",
    "secrets",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "socketserver",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "traceback",
    "types",
    "typing",
    "unittest",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "zipfile",
    "zoneinfo",
)

# Word counts: "short" is a few words, "long" is well over 256 word-pieces for a BERT tokenizer.
SHORT_MAX_WORDS = 8
LONG_MIN_WORDS = 210


def _doc(obj: object) -> str | None:
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str):
        return None
    doc = inspect.cleandoc(doc).strip()
    return doc or None


def _module_docs(name: str) -> list[str]:
    # Some modules warn on import or on attribute access (typing.io); the docstrings are what we want.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _collect_module_docs(name)


def _collect_module_docs(name: str) -> list[str]:
    try:
        module = importlib.import_module(name)
    except ImportError:
        return []
    docs = [_doc(module)]
    for attr in sorted(vars(module)):
        obj = vars(module)[attr]
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            docs.append(_doc(obj))
            docs.extend(_doc(member) for _, member in sorted(vars(obj).items()) if callable(member))
        elif callable(obj):
            docs.append(_doc(obj))
    return [d for d in docs if d]


@functools.lru_cache(maxsize=1)
def _pool() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(short, medium, long) texts, deduplicated, in a fixed order."""
    seen: set[str] = set()
    texts: list[str] = []
    for name in MODULES:
        for doc in _module_docs(name):
            first_line = doc.splitlines()[0].strip()
            for text in (doc, first_line):
                if text and text not in seen:
                    seen.add(text)
                    texts.append(text)
    short = tuple(t for t in texts if len(t.split()) <= SHORT_MAX_WORDS)
    long = tuple(t for t in texts if len(t.split()) >= LONG_MIN_WORDS)
    medium = tuple(t for t in texts if SHORT_MAX_WORDS < len(t.split()) < LONG_MIN_WORDS)
    return short, medium, long


def _take(bucket: tuple[str, ...], k: int, rng: random.Random) -> list[str]:
    """k texts from the bucket in a seeded order, repeating the bucket only when k exceeds it."""
    order = list(bucket)
    rng.shuffle(order)
    return [order[i % len(order)] for i in range(k)]


def stdlib_texts(n: int, seed: int = 0) -> list[str]:
    """n real texts: about 20% a few words long, 15% long (over 256 word-pieces), the rest in between.

    Texts repeat only when n is larger than the pool (several thousand texts). The order is shuffled
    with `seed`; the same (n, seed) gives the same list on the same Python.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, not {n}")
    short, medium, long = _pool()
    rng = random.Random(seed)
    n_short = min(n, max(1, round(n * 0.20)))
    n_long = min(n - n_short, max(1, round(n * 0.15)))
    n_medium = n - n_short - n_long
    texts = _take(short, n_short, rng) + _take(medium, n_medium, rng) + _take(long, n_long, rng)
    rng.shuffle(texts)
    return texts


def pool_sizes() -> dict[str, int]:
    """How many distinct texts each length bucket holds (for benchmark reports)."""
    short, medium, long = _pool()
    return {"short": len(short), "medium": len(medium), "long": len(long)}
