"""The docs against the code they describe.

- docs/configuration.md is what docs/gen_config.py renders from the CLI's own parser.
- Every code name README.md, tests/README.md and docs/*.md (less the generated page) cite
  in backticks still exists:
  file paths (`router/placement.py`, `tcp_conn.py`, `tests/e2e/test_cli.py::test_x`),
  modules (`pdserve.engine.block_pool`), `Class.attr` of a class defined in the package
  (`Placement.reserve`), and a name cited right after its file (`engine/stop.py`
  `stop_state`) defined in that file.
- No page or source file names a work session or an issue number, and no link leaves the
  repository.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib
import importlib.util
import inspect
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "tests" / "README.md",
         *sorted((ROOT / "docs").glob("*.md"))]
# pyproject.toml's [tool.setuptools.package-dir]: the folder each subpackage installs from
PACKAGE_DIRS = {"pdserve": "pdserve", "engine": "pdserve.engine", "router": "pdserve.router",
                "prefill_worker": "pdserve.prefill_worker",
                "decode_worker": "pdserve.decode_worker",
                "kv_transfer": "pdserve.kv_transfer", "proto": "pdserve.proto"}
_PRUNE = {".git", "__pycache__", ".pytest_cache", ".cache", ".site", "build", "node_modules"}
# endings that make a backticked word a file name
_FILE_ENDINGS = (".py", ".proto", ".yaml", ".yml", ".json", ".cpp", ".h", ".md", ".toml",
                 ".tpl", ".sh")


@cache
def repo_paths() -> frozenset[str]:
    """Every file and folder of the working tree, relative to ROOT, less virtual
    environments, caches and build output."""
    found = set()

    def walk(d: Path) -> None:
        for p in d.iterdir():
            if p.name in _PRUNE or p.name.startswith(".venv") or p.name.endswith(".egg-info"):
                continue
            found.add(p.relative_to(ROOT).as_posix())
            if p.is_dir() and not p.is_symlink():
                walk(p)
    walk(ROOT)
    return frozenset(found)


@cache
def dir_names() -> frozenset[str]:
    return frozenset(p.rsplit("/", 1)[-1] for p in repo_paths() if (ROOT / p).is_dir())


def code_spans(text: str) -> list[tuple[str, str]]:
    """(span, the text after it up to the next span) for each inline code span outside
    fenced blocks, white space folded."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    matches = list(re.finditer(r"`([^`]+)`", prose))
    return [(" ".join(m[1].split()), prose[m.end():matches[i + 1].start()]
             if i + 1 < len(matches) else "") for i, m in enumerate(matches)]


def is_path(span: str) -> bool:
    if span.startswith(("/", "~", "$", "http")) or not re.fullmatch(r"[\w.\-/*]+(::\w+)?", span):
        return False
    name = span.split("::")[0]
    if re.fullmatch(r"\.\w+", name):     # an ending alone: `.md`
        return False
    return name.endswith(_FILE_ENDINGS) or ("/" in name and name.split("/")[0] in dir_names())


def resolve_path(span: str) -> list[str]:
    """The repository paths a cited path names: itself, or a path ending with it (`tcp.py`,
    `bench/commands.py` inside pdserve/), or what a glob matches."""
    name = span.split("::")[0].rstrip("/")
    if "*" in name:
        return [p for p in repo_paths()
                if fnmatch.fnmatch(p, name) or fnmatch.fnmatch(p, "*/" + name)]
    return [p for p in repo_paths() if p == name or p.endswith("/" + name)]


def defines(path: str, name: str) -> bool:
    """Whether the file defines `name`: a function, class, field, assignment or `self.name`."""
    n = re.escape(name)
    return re.search(rf"\b(def|class)\s+{n}\b|^\s*{n}\s*[:=]|\bself\.{n}\s*(:[^=\n]*)?=",
                     (ROOT / path).read_text(errors="replace"), flags=re.M) is not None


@cache
def package_classes() -> dict[str, list[tuple[str, ast.ClassDef]]]:
    """Class name -> (module, its ClassDef) for every class the package's sources define."""
    classes: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for folder, package in PACKAGE_DIRS.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            parts = f.relative_to(ROOT / folder).with_suffix("").parts
            module = ".".join((package, *parts))
            if parts[-1] == "__init__":
                module = module.removesuffix(".__init__")
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                if isinstance(node, ast.ClassDef):
                    classes.setdefault(node.name, []).append((module, node))
    return classes


def _ast_has(node: ast.ClassDef, attr: str, seen: set[str]) -> bool:
    """`attr` is a method, class attribute, field or `self.attr` store of the class, or
    of a base class the package defines."""
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == attr:
            return True
        if isinstance(n, ast.Name) and n.id == attr and isinstance(n.ctx, ast.Store):
            return True
        if (isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.ctx, ast.Store)
                and isinstance(n.value, ast.Name) and n.value.id == "self"):
            return True
    for base in node.bases:
        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
        if name and name not in seen:
            seen.add(name)
            if any(_ast_has(b, attr, seen) for _, b in package_classes().get(name, [])):
                return True
    return False


def class_has(cls_name: str, attr: str) -> bool:
    """A class of that name in the package has `attr`: read from the source first; else
    imported (attributes made at runtime, or inherited from outside the package)."""
    found = package_classes().get(cls_name, [])
    if any(_ast_has(node, attr, {cls_name}) for _, node in found):
        return True
    for module, _ in found:
        cls = getattr(importlib.import_module(module), cls_name, None)
        if cls is not None and (hasattr(cls, attr) or any(
                attr in getattr(k, "__annotations__", {}) for k in inspect.getmro(cls))):
            return True
    return False


def module_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def missing_names(page: Path) -> list[str]:
    """The code names `page` cites that the repository no longer has, each with why."""
    spans = code_spans(page.read_text())
    missing = []
    for i, (span, after) in enumerate(spans):
        if is_path(span):
            paths = resolve_path(span)
            if not paths:
                missing.append(f"{span} (no such file)")
            elif "::" in span:
                test = span.split("::", 1)[1]
                if not any(defines(p, test) for p in paths):
                    missing.append(f"{span} (no {test} in {paths[0]})")
            elif span.endswith(".py") and re.fullmatch(r" (— )?", after) and i + 1 < len(spans):
                # "`file.py` `name`", "`file.py` — `Class.method`": defined in that file
                name = re.match(r"(_?[A-Za-z]\w*)(?=[.(]|$)", spans[i + 1][0])
                if name and not is_path(spans[i + 1][0]) and not any(
                        defines(p, name[1]) for p in paths):
                    missing.append(f"{span} {spans[i + 1][0]} (no {name[1]} in {paths[0]})")
            continue
        m = re.fullmatch(r"(_?[A-Z][A-Za-z0-9_]+)\.([a-z_]\w*)(\(.*\))?", span)
        if m:
            if not package_classes().get(m[1]):
                missing.append(f"{span} (no class {m[1]} in the package)")
            elif not class_has(m[1], m[2]):
                missing.append(f"{span} ({m[1]} has no {m[2]})")
        elif re.fullmatch(r"pdserve(\.\w+)+", span) and not span.startswith("pdserve.v1"):
            if not module_exists(span):
                missing.append(f"{span} (no such module or attribute)")
    return missing


def _gen_config():
    spec = importlib.util.spec_from_file_location("gen_config", ROOT / "docs" / "gen_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_page_is_the_cli_parser_rendered():
    gen = _gen_config()
    assert gen.PAGE.read_text() == gen.render(), (
        f"docs/configuration.md differs from the CLI's flags: run `{gen.REGENERATE}` to "
        "regenerate it")


def test_every_code_name_the_docs_cite_exists():
    # configuration.md is the parser rendered (its defaults name outputs, not sources)
    missing = {p.relative_to(ROOT).as_posix(): m for p in PAGES
               if p.name != "configuration.md" and (m := missing_names(p))}
    assert not missing, f"the docs cite names the code no longer has: {missing}"


def test_the_name_check_reports_what_is_gone(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "`router/placement.py` — `Placement.reserve`, `tcp_conn.py`, `engine/` and\n"
        "`pdserve.engine.block_pool`; `tests/unit/test_docs.py::test_the_name_check_reports_what_is_gone`.\n"
        "Gone: `engine/no_such.py`, `Placement.no_such_attr`, `NoSuchClass.x`,\n"
        "`pdserve.engine.no_such`, `engine/stop.py` `no_such_function`,\n"
        "`tests/unit/test_docs.py::test_no_such`. Not code: `sampling.n`, `Admin.Scale`.\n"
        "```\n`engine/fenced_is_not_read.py`\n```\n")
    assert missing_names(page) == [
        "engine/no_such.py (no such file)",
        "Placement.no_such_attr (Placement has no no_such_attr)",
        "NoSuchClass.x (no class NoSuchClass in the package)",
        "pdserve.engine.no_such (no such module or attribute)",
        "engine/stop.py no_such_function (no no_such_function in engine/stop.py)",
        "tests/unit/test_docs.py::test_no_such (no test_no_such in tests/unit/test_docs.py)"]


# A page states what is; the history of how it came to be is git's.
_DIARY = re.compile(r"(session|issue) #?[0-9]", re.I)
_OUTSIDE = re.compile(r"\.\.[/]shared")


def test_no_page_or_source_narrates_or_points_outside_the_repository():
    files = PAGES + [ROOT / p for p in sorted(repo_paths()) if p.endswith(".py")]
    found = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}"
             for f in files for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
             if _DIARY.search(line) or _OUTSIDE.search(line)]
    assert not found, "state facts (a date, a commit) instead:\n" + "\n".join(found)


def test_relative_links_resolve_inside_the_repository():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists() or not path.is_relative_to(ROOT):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, f"links to nothing, or out of the repository: {broken}"
