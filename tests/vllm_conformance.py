"""Compare a KV connector class with vLLM's `KVConnectorBase_V1` as written in a release's
`vllm/distributed/kv_transfer/kv_connector/v1/base.py`, read as source (ast), so that a
release that is not installed (0.33's wheel, `make test-vllm-033`) is checked as the
installed one is (tests/client/vllm/test_vllm_conformance.py).

What is a problem: an abstract method of the base class the connector lacks; a method the
connector defines that the base class has with other parameters (names, order, kinds; the
connector may add parameters only at the end, with defaults) or of another kind (a
classmethod, staticmethod or property on one side only).
"""

import ast
import inspect

BASE_CLASS = "KVConnectorBase_V1"


def _kind(decorators: list[ast.expr]) -> str:
    names = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in decorators}
    for kind in ("classmethod", "staticmethod", "property"):
        if kind in names:
            return kind
    return "method"


def _params(args: ast.arguments, kind: str) -> list[tuple[str, str, bool]]:
    """(name, kind, has_default) of each parameter, without self / cls."""
    positional = [(a.arg, "POSITIONAL_ONLY") for a in args.posonlyargs]
    positional += [(a.arg, "POSITIONAL_OR_KEYWORD") for a in args.args]
    num_defaults = len(args.defaults)
    params = [(name, k, i >= len(positional) - num_defaults)
              for i, (name, k) in enumerate(positional)]
    if kind in ("method", "classmethod", "property") and params:
        params = params[1:]
    if args.vararg is not None:
        params.append((args.vararg.arg, "VAR_POSITIONAL", False))
    params += [(a.arg, "KEYWORD_ONLY", d is not None)
               for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg is not None:
        params.append((args.kwarg.arg, "VAR_KEYWORD", False))
    return params


def base_methods(source: str) -> dict[str, dict]:
    """name -> {"kind", "abstract", "params"} of every method `KVConnectorBase_V1` defines
    in `source` (a base.py)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == BASE_CLASS:
            break
    else:
        raise ValueError(f"no class {BASE_CLASS} in the source given")
    methods = {}
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kind = _kind(item.decorator_list)
            abstract = any(getattr(d, "id", getattr(d, "attr", "")) == "abstractmethod"
                           for d in item.decorator_list)
            if kind == "property" and item.name in methods:
                continue  # a setter: the getter is what callers see
            methods[item.name] = {"kind": kind, "abstract": abstract,
                                  "params": _params(item.args, kind)}
    return methods


def _own_member(cls: type, name: str):
    """(kind, function) of `name` as the first class of `cls`'s MRO before the vLLM base
    class defines it, or None when only the base class (or nothing) does."""
    for klass in cls.__mro__:
        if klass.__name__ == BASE_CLASS:
            return None
        if name in vars(klass):
            member = vars(klass)[name]
            if isinstance(member, classmethod):
                return "classmethod", member.__func__
            if isinstance(member, staticmethod):
                return "staticmethod", member.__func__
            if isinstance(member, property):
                return "property", member.fget
            return "method", member
    return None


def _signature(kind: str, function) -> list[tuple[str, str, bool]]:
    params = list(inspect.signature(function).parameters.values())
    if kind != "staticmethod":
        params = params[1:]
    return [(p.name, p.kind.name, p.default is not inspect.Parameter.empty) for p in params]


def conformance_problems(base_source: str, connector_cls: type) -> list[str]:
    """What keeps `connector_cls` from conforming to the base class in `base_source`
    (empty: it conforms). See the module docstring."""
    problems = []
    for name, base in sorted(base_methods(base_source).items()):
        own = _own_member(connector_cls, name)
        if own is None:
            if base["abstract"]:
                problems.append(f"{name}: abstract in vLLM's base class, not implemented")
            continue
        kind, function = own
        if kind != base["kind"]:
            problems.append(f"{name}: a {kind} here, a {base['kind']} in vLLM's base class")
            continue
        ours, theirs = _signature(kind, function), base["params"]
        head = [(n, k) for n, k, _ in ours[: len(theirs)]]
        if head != [(n, k) for n, k, _ in theirs] or any(
                not has_default and k not in ("VAR_POSITIONAL", "VAR_KEYWORD")
                for _, k, has_default in ours[len(theirs):]):
            problems.append(f"{name}: parameters {[(n, k) for n, k, _ in ours]} here, "
                            f"{[(n, k) for n, k, _ in theirs]} in vLLM's base class")
    return problems
