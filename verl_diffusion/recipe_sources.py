"""Each recipe against its published source: ``python -m verl_diffusion.recipe_sources [--write|--check FILE]``.

``verl_diffusion/recipes/sources/<recipe>.yaml`` lists, per parameter, the config key, the source's value and where
the source gives it (section, table, config function), and, where ours differs or the source is silent, why. The
table in docs/recipes.md ("Recipes against their sources") is rendered from those files and from the *composed*
recipe (the value our run uses), so it cannot drift: tests/trainer/test_recipe_sources_on_cpu.py fails when the
document differs from the rendering, and when a row differs from its source (or the source is silent) without a
reason.

A sources file::

    source: <the papers / code the recipe follows, one line>
    include: [_flow_grpo_sd35]          # shared rows (sources/_<name>.yaml), overridden by key below
    rows:
      - {key: data.train_batch_size, source: 48, where: "grpo.py general_ocr_sd3: 48 groups per epoch"}
      - {key: actor_rollout_ref.model.dtype, source: fp16, where: "base.py mixed_precision", why: "bf16: ..."}
      - {key: ..., source: silent, where: "-", why: "source silent: we use X because Y"}
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, Optional

BEGIN = "<!-- recipe-sources:begin (python -m verl_diffusion.recipe_sources --write docs/recipes.md) -->"
END = "<!-- recipe-sources:end -->"
SILENT = "silent"


def sources_dir() -> str:
    from verl_diffusion.recipe_index import recipes_dir

    return os.path.join(recipes_dir(), "sources")


def load(name: str, folder: Optional[str] = None) -> dict:
    """The sources of recipe ``name`` with its includes merged (rows keyed by config key, the recipe's own last)."""
    import yaml

    folder = folder or sources_dir()
    with open(os.path.join(folder, f"{name}.yaml")) as f:
        spec = yaml.safe_load(f)
    rows: dict[str, dict] = {}
    for inc in spec.get("include", []) or []:
        for row in load(inc, folder)["rows"]:
            rows[row["key"]] = row
    for row in spec.get("rows", []) or []:
        rows[row["key"]] = row
    return {"source": spec.get("source", ""), "rows": list(rows.values())}


def same(ours: Any, source: Any) -> bool:
    if isinstance(source, str) and source == SILENT:
        return False
    if isinstance(ours, (list, tuple)) and isinstance(source, (list, tuple)):
        return len(ours) == len(source) and all(same(a, b) for a, b in zip(ours, source))
    if isinstance(ours, bool) or isinstance(source, bool):
        return ours is source or ours == source
    if isinstance(ours, (int, float)) and isinstance(source, (int, float)):
        return math.isclose(float(ours), float(source), rel_tol=1e-9, abs_tol=1e-12)
    return ours == source


def fmt(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(fmt(x) for x in v) + "]"
    return str(v)


def table_rows(name: str, cfg) -> list[dict]:
    """Each sources row with ``ours`` (the composed recipe's value) and ``same`` (yes / no / silent)."""
    from omegaconf import OmegaConf

    out = []
    for row in load(name)["rows"]:
        value = OmegaConf.select(cfg, row["key"], default="<missing>")
        if not isinstance(value, (str, int, float, bool, type(None))):
            value = OmegaConf.to_container(value, resolve=True)
        src = row["source"]
        verdict = "silent" if src == SILENT else ("yes" if same(value, src) else "no")
        out.append({**row, "ours": value, "same": verdict})
    return out


def render_recipe(name: str, cfg) -> str:
    spec = load(name)
    lines = [f"### `{name}`", "", f"Source: {spec['source']}", "",
             "| parameter | source value (where) | ours | same? |", "|---|---|---|---|"]
    for r in table_rows(name, cfg):
        src = "silent" if r["same"] == "silent" else fmt(r["source"])
        where = f" ({r['where']})" if r.get("where") not in (None, "", "-") else ""
        verdict = {"yes": "yes", "no": f"no: {r.get('why', '')}", "silent": r.get("why", "")}[r["same"]]
        lines.append(f"| `{r['key']}` | {src}{where} | {fmt(r['ours'])} | {verdict.rstrip(': ')} |")
    return "\n".join(lines) + "\n"


def recipes_with_sources() -> list[str]:
    folder = sources_dir()
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml") and not f.startswith("_"))


def render_all() -> str:
    from hydra import compose, initialize_config_dir

    from verl_diffusion.recipe_index import recipes_dir, searchpath_overrides

    search = searchpath_overrides()
    parts = [BEGIN, ""]
    with initialize_config_dir(config_dir=recipes_dir(), version_base="1.3"):
        for name in recipes_with_sources():
            parts.append(render_recipe(name, compose(config_name=name, overrides=search)))
    parts.append(END)
    return "\n".join(parts)


def replace_block(text: str, block: str) -> str:
    if BEGIN not in text or END not in text:
        raise ValueError(f"the document has no {BEGIN!r} ... {END!r} block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + block + tail


def main(argv: Optional[list] = None) -> None:
    os.environ.setdefault("VERL_PLATFORM", "cpu")
    p = argparse.ArgumentParser(prog="python -m verl_diffusion.recipe_sources", description=__doc__.splitlines()[0])
    p.add_argument("--write", metavar="FILE", help="replace the marked block of FILE with the rendering")
    p.add_argument("--check", metavar="FILE", help="exit 1 when FILE's marked block differs from the rendering")
    args = p.parse_args(argv)
    block = render_all()
    if args.write or args.check:
        path = args.write or args.check
        with open(path) as f:
            text = f.read()
        new = replace_block(text, block)
        if args.check:
            if new != text:
                print(f"{path}: the recipe source tables are stale; run python -m verl_diffusion.recipe_sources "
                      f"--write {path}", file=sys.stderr)
                sys.exit(1)
            return
        with open(path, "w") as f:
            f.write(new)
        return
    print(block)


if __name__ == "__main__":
    main()
