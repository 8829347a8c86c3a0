"""The bench's floor of a step (flashinfer_a2a.bench.floor) from what docs/measurements/link_floor.py writes, and
the probe's kernels compiling for the architectures it runs on."""

import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys
import types

import pytest

from flashinfer_a2a.bench import floor
from flashinfer_a2a.bench.args import parse_args

PROBE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "measurements" / "link_floor.py"


def _probe_json(tmp_path, **change) -> str:
    figures = {"gpu": "H100", "gpus": 2, "blocks_per_sm": 2,
               "store": {"1": {"1000": 100.0, "1000000": 400.0}},
               "load": {"1": {"1000": 50.0, "1000000": 250.0}},
               "one_way_us": {"1": 2.0}, "handshake_us": {"2": 3.0}}
    figures.update(change)
    path = tmp_path / "floor.json"
    path.write_text(json.dumps(figures))
    return str(path)


def test_pair_floor_is_two_handshakes_plus_the_bytes_at_the_best_rate(tmp_path):
    link = floor.load(_probe_json(tmp_path))
    # 2 x 3 us and both phases' 13000 bytes at the best of the stores' 400 and the loads' 250 bytes/us
    assert floor.pair_floor_us(link, 2, 8000.0, 5000.0) == pytest.approx(6.0 + 32.5)
    assert floor.pair_floor_us(link, 2, 0.0, 0.0) == pytest.approx(6.0)
    # loads faster than stores: the loads' rate
    link = floor.load(_probe_json(tmp_path, load={"1": {"1000000": 520.0}}))
    assert floor.pair_floor_us(link, 2, 8000.0, 5000.0) == pytest.approx(6.0 + 25.0)
    # another engine faster than the SM: its rate (the buffer size it was measured at is no rate)
    engines = {"1": {"bytes": 1e9, "sm": 400.0, "tma": 390.0, "copy_engine": 650.0}}
    link = floor.load(_probe_json(tmp_path, store_engines=engines))
    assert floor.pair_floor_us(link, 2, 8000.0, 5000.0) == pytest.approx(6.0 + 20.0)
    engines["1"]["copy_engine"] = 100.0
    link = floor.load(_probe_json(tmp_path, store_engines=engines))
    assert floor.pair_floor_us(link, 2, 8000.0, 5000.0) == pytest.approx(6.0 + 32.5)


def test_floor_refuses_a_file_of_other_gpus_or_fields(tmp_path):
    link = floor.load(_probe_json(tmp_path))
    with pytest.raises(floor.FloorError, match=r"no figures for 4 ranks \(it was measured on 2 GPUs\)"):
        floor.pair_floor_us(link, 4, 1.0, 1.0)
    with pytest.raises(floor.FloorError, match="2 or more ranks"):
        floor.pair_floor_us(link, 1, 1.0, 1.0)
    floor.check_ranks(link, 2)  # what the bench checks once its ranks are known, before any case
    with pytest.raises(floor.FloorError, match="no figures for 3 ranks"):
        floor.check_ranks(link, 3)
    no_loads = floor.load(_probe_json(tmp_path, load={"2": {"1000": 50.0}}))
    with pytest.raises(floor.FloorError, match="no figures for 2 ranks"):
        floor.check_ranks(no_loads, 2)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"store": {}}))
    with pytest.raises(floor.FloorError, match="has no 'load'"):
        floor.load(str(bad))
    assert floor.load(None) is None


def test_bench_takes_the_floor_file():
    assert parse_args(["--floor", "floor.json"]).floor == "floor.json"
    assert parse_args([]).floor is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_probe_kernels_compile(tmp_path):
    """The probe's CUDA source (compiled by cupy at run time) compiles for sm_90a and sm_100a."""
    source = PROBE.read_text().split('KERNELS = r"""', 1)[1].split('"""', 1)[0]
    (tmp_path / "probe.cu").write_text(source)
    for arch in ("sm_90a", "sm_100a"):
        result = subprocess.run(["nvcc", "-std=c++17", f"-arch={arch}", "-cubin", "-o", str(tmp_path / "probe.cubin"),
                                 str(tmp_path / "probe.cu")], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


def _probe_module(monkeypatch):
    """link_floor.py loaded with cupy (absent here) stood in for by a module whose use would fail."""
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=object))
    spec = importlib.util.spec_from_file_location("link_floor_under_test", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


def test_probe_describes_what_the_bytes_add(monkeypatch):
    """The added time of each size prints with the rate it implies for the GPU's peers together; a file the bench
    reads (which has these figures or not) describes either way."""
    probe = _probe_module(monkeypatch)
    figures = {"gpu": "H100", "gpus": 4, "blocks_per_sm": 2, "store": {}, "load": {},
               "one_way_us": {"1": 2.0}, "handshake_us": {"2": 3.0}}
    assert "what the bytes add" not in probe.describe(figures)
    figures["added_us"] = {"store": {"1": {"1843200": 5.49}, "3": {"921600": 8.0}}, "load": {"2": {"230400": 3.2}}}
    text = probe.describe(figures)
    assert "store kernel (1 peer(s)" in text and "1.84 MB/peer +5.49 us (336 GB/s)" in text
    assert "store kernel (3 peer(s)" in text and "0.92 MB/peer +8.00 us (346 GB/s)" in text
    assert "load kernel (2 peer(s)" in text and "0.23 MB/peer +3.20 us (144 GB/s)" in text


@pytest.mark.parametrize("launcher_size", ["WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_probe_refuses_to_run_as_one_of_several_ranks(launcher_size, monkeypatch, capsys):
    """Launched by torchrun or mpirun, every rank would run the whole probe over every GPU at once: it says so and
    measures nothing."""
    probe = _probe_module(monkeypatch)
    monkeypatch.setattr(probe, "measure", lambda *args: pytest.fail("measured under a launcher"))
    for name in probe.LAUNCHER_SIZES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(launcher_size, "4")
    assert probe.main([]) == 2
    assert f"{launcher_size}=4" in capsys.readouterr().err
    monkeypatch.setenv(launcher_size, "1")  # one rank of one: the probe runs
    measured = []
    monkeypatch.setattr(probe, "measure", lambda *args: measured.append(args) or {})
    monkeypatch.setattr(probe, "describe", lambda result: "described")
    assert probe.main(["--sizes", "4096", "--added-sizes", "512", "1024"]) == 0
    assert measured == [([4096], 2, [512, 1024])]
