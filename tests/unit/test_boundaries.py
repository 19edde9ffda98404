"""The boundaries of the process roles and of the inputs package, read from the source with `ast` as
test_imports.py reads imports: no attribute delegation in the engine and the server (classes say what they
offer), no server class handed to a child process (a child builds its own objects), and tokenizing only in
engine/inputs/ (what a front-end process runs)."""

from __future__ import annotations

import ast

from tests.unit.test_imports import imports, internal_imports, modules


def _tree(module: str) -> ast.Module:
    return ast.parse(modules()[module][0].read_text())


def test_no_getattr_delegation_in_the_engine_and_the_server() -> None:
    """Classes say what they offer: no __getattr__ (or __getattribute__) passing calls to another object
    (an adapter's core, a remote core) in engine/ and server/."""
    report = []
    for module in sorted(m for m in modules() if m.startswith(("embedserv.engine", "embedserv.server"))):
        for node in ast.walk(_tree(module)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in (
                "__getattr__",
                "__getattribute__",
            ):
                report.append(f"{module}:{node.lineno} defines {node.name}")
    assert not report, "attribute delegation:\n" + "\n".join(report)


def _server_classes() -> set[str]:
    return {
        node.name
        for module in modules()
        if module.startswith("embedserv.server")
        for node in _tree(module).body
        if isinstance(node, ast.ClassDef)
    }


def test_no_server_class_is_handed_to_a_child_process() -> None:
    """A child process builds its own objects: no argument to a Process (or a Popen) is a class of the server,
    nor `type(...)` of one; the front-end process module imports the server role it runs itself."""
    classes = _server_classes()
    report = []
    for module in sorted(modules()):
        for node in ast.walk(_tree(module)):
            if not (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", ""))
                in (
                    "Process",
                    "Popen",
                )
            ):
                continue
            for part in ast.walk(ast.Tuple(elts=[*node.args, *(k.value for k in node.keywords)])):
                name = getattr(part, "id", None) or getattr(part, "attr", None)
                is_type_call = isinstance(part, ast.Call) and getattr(part.func, "id", None) == "type"
                if name in classes or is_type_call or (name or "").endswith("_class"):
                    report.append(f"{module}:{node.lineno} hands {name or 'type(...)'} to a child process")
    assert not report, "\n".join(report)
    assert "embedserv.server.frontend_server" in internal_imports("embedserv.server.frontend_process")


# Modules outside engine/inputs/ that open a tokenizer only to look up token ids when the worker loads (a yes/no
# reranker's "yes" and "no", bge-m3's special ids): they tokenize nothing.
_VOCABULARY_LOOKUPS = {"embedserv.worker.replica", "embedserv.models.heads.bge_m3"}
_TOKENIZING_CALLS = {
    "encode",
    "encode_batch",
    "encode_plus",
    "batch_encode_plus",
    "apply_chat_template",
    "tokenize",
    "post_process",
    "decode",
}


def _opens_a_tokenizer(module: str) -> bool:
    if "tokenizers" in imports(module):
        return True
    return any(
        isinstance(node, ast.ImportFrom)
        and node.module == "transformers"
        and any("Tokenizer" in alias.name for alias in node.names)
        for node in ast.walk(_tree(module))
    )


def test_nothing_outside_engine_inputs_tokenizes() -> None:
    """Turning a call into model inputs is engine/inputs/'s (what a front-end process runs): no module outside it
    opens a tokenizer, but the worker's id lookups, which call no tokenizing method."""
    outside = [m for m in modules() if not m.startswith("embedserv.engine.inputs") and _opens_a_tokenizer(m)]
    assert sorted(set(outside) - _VOCABULARY_LOOKUPS) == [], "tokenizers outside engine/inputs/"
    for module in _VOCABULARY_LOOKUPS:
        calls = {
            node.func.attr
            for node in ast.walk(_tree(module))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        }
        assert not calls & _TOKENIZING_CALLS, f"{module} tokenizes: {sorted(calls & _TOKENIZING_CALLS)}"
