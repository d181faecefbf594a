"""tools.bench_recovery end to end at tiny sizes: the tier mode and the whole-engine mode.

No wall-clock assertions (DESIGN.md §5): counts of files, bytes read and a real SSD hit.
"""

import json

from tqserve.tools.bench_recovery import main


def test_tier_recovery_reads_headers_only(tmp_path):
    out = tmp_path / "tier.json"
    assert main(["--files", "20", "--file-kb", "64", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["num_loaded"] == 20 and report["seconds"] > 0
    assert 0 < report["bytes_read"] < report["bytes_on_disk"] // 50


def test_engine_start_over_real_snapshots_then_a_hit(tmp_path):
    out = tmp_path / "engine.json"
    assert main(["--engine", "--files", "12", "--tokens", "40", "--repeats", "2",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mode"] == "engine" and len(report["all_seconds"]) == 2
    # The finished row's snapshot (its 40 prompt tokens and the one it generated: the
    # engine releases finished rows before it closes); it supersedes the prompt's own
    # snapshot (39 tokens), so one source file is indexed.
    assert report["tokens_per_file"] == 41
    assert report["ssd_entries"] == 13  # the 12 copies and the file they were copied from
    assert report["hit_after_start"] == {"hits_ssd": 1, "quarantined": 0}


def test_bad_sizes_exit_2(capsys):
    try:
        main(["--engine", "--tokens", "1"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("--tokens 1 was accepted")
    assert "--tokens >= 2" in capsys.readouterr().err
