"""benchmarks/paired_validation.py: the paired gain between two validation files, composition-weighted per tag."""

import json


def _write(path, strict):
    # One tag, two compositions: "a" drawn twice, "b" once; each composition weighs 1/2, so a's images 1/4 each.
    rows = [("a", 0), ("a", 1), ("b", 2)]
    with open(path, "w") as f:
        for (comp, seed), value in zip(rows, strict):
            f.write(json.dumps({"prompt": f"p{comp}", "seed": seed, "reward": value, "shapes/strict": value,
                                "tag": "counting", "composition": comp}) + "\n")
    return str(path)


def test_paired_gain_and_standard_error(load_benchmark, tmp_path, capsys):
    pv = load_benchmark("paired_validation")
    a = _write(tmp_path / "a.jsonl", [0.0, 0.0, 0.0])
    b = _write(tmp_path / "b.jsonl", [1.0, 0.0, 1.0])
    assert pv.main([a, b]) == 0
    out = capsys.readouterr().out
    # gain = 1/4·1 + 1/4·0 + 1/2·1 = 75 points; s.e. = sqrt(Σ w²)·sd(d) = sqrt(0.375)·sqrt(1/3) = 35.4 points
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("counting"))
    assert "0.0%" in line and "75.0%" in line and "+75.0 ± 35.4" in line


def test_files_of_other_images_are_refused(load_benchmark, tmp_path, capsys):
    pv = load_benchmark("paired_validation")
    a = _write(tmp_path / "a.jsonl", [0.0, 0.0, 0.0])
    b = _write(tmp_path / "b.jsonl", [1.0, 0.0])
    assert pv.main([a, b]) == 2
    assert "not validations of the same images" in capsys.readouterr().err
