"""compare/power.py: reason decoding, window summaries, and the inactive sampler on machines without NVML."""

import os
import time

import pytest

from compare import power


def test_decode_reasons_names_bits_and_keeps_unknown_ones():
    assert power.decode_reasons(0) == []
    assert power.decode_reasons(0x4) == ["sw_power_cap"]
    assert power.decode_reasons(0x1 | 0x4 | 0x40) == ["gpu_idle", "sw_power_cap", "hw_thermal_slowdown"]
    assert power.decode_reasons(0x4 | 0x2000) == ["sw_power_cap", "0x2000"]


def test_summarize_medians_extremes_and_reason_union():
    samples = [(0.0, 1980.0, 300.0, 40.0, 0x0), (0.02, 1515.0, 699.0, 55.0, 0x4), (0.04, 1290.0, 701.0, 57.0, 0x4),
               (0.06, 1700.0, 650.0, 51.0, 0x1)]
    w = power.summarize(samples)
    assert w == {"samples": 4, "sm_mhz_median": (1515.0 + 1700.0) / 2, "sm_mhz_min": 1290.0,
                 "power_w_median": (650.0 + 699.0) / 2, "power_w_max": 701.0, "temp_c_max": 57.0,
                 "reasons": ["gpu_idle", "sw_power_cap"]}
    assert power.summarize([]) is None


class _FakeNvml:
    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0

    def __init__(self):
        self.calls = 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x4

    def nvmlDeviceGetClockInfo(self, h, kind):
        assert kind == self.NVML_CLOCK_SM
        self.calls += 1
        return 1500 + self.calls

    def nvmlDeviceGetPowerUsage(self, h):
        return 698_500  # mW

    def nvmlDeviceGetTemperature(self, h, kind):
        return 60

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700_000

    def nvmlShutdown(self):
        pass


def test_sampler_windows_samples_from_a_fake_nvml():
    """The thread sampler (``mode="thread"``: the process sampler's child cannot take a fake) over a fake NVML."""
    s = power.PowerSampler.__new__(power.PowerSampler)
    power.PowerSampler.__init__(s, mode="thread")  # real init: on this machine NVML is missing or has no GPU
    s._nvml, s._handle, s.unavailable = _FakeNvml(), object(), None
    t0 = time.time()
    with s:
        time.sleep(0.15)
    t1 = time.time()
    w = s.window(t0, t1)
    assert w is not None and w["samples"] >= 3
    assert w["power_w_max"] == pytest.approx(698.5) and w["reasons"] == ["sw_power_cap"]
    assert 1500 < w["sm_mhz_min"] <= w["sm_mhz_median"] < 1500 + w["samples"] + 1
    assert s.window(t1 + 10, t1 + 20) is None  # no samples in that window
    assert s.power_limit_w() == 700.0


def test_sampler_without_nvml_is_inactive_with_a_reason(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pynvml(name, *a, **k):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    s = power.PowerSampler()
    assert not s.active and "pynvml" in s.unavailable
    with s:
        pass
    assert s.window(0, time.time()) is None and s.power_limit_w() is None


def test_nvml_index_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert power._nvml_index(1) == 5
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")
    assert power._nvml_index(1) == 1


def test_power_sample_loop_and_reader_round_trip(tmp_path):
    """The sampling process's loop writes one line per sample; the reader returns exactly the complete lines
    (a line still being written is skipped); an unknown mode is a clear error; "off" is inactive."""
    f = tmp_path / "samples.txt"
    vals = iter([(100.5, 1980.0, 650.25, 55.0, 0), (100.52, 1515.0, 700.0, 61.0, 4), (100.54, 1470.0, 699.5, 62.0, 5)])
    assert power.sample_loop(lambda: next(vals), str(f), 0.0, max_samples=3) == 3
    with open(f, "a") as fh:
        fh.write("100.56 1400 69")  # cut mid-line
    got = power.read_samples(str(f))
    assert got == [(100.5, 1980.0, 650.25, 55.0, 0), (100.52, 1515.0, 700.0, 61.0, 4), (100.54, 1470.0, 699.5, 62.0, 5)]
    summ = power.summarize([s for s in got if 100.51 <= s[0] <= 100.6])
    assert summ["samples"] == 2 and summ["sm_mhz_min"] == 1470.0 and summ["reasons"] == ["gpu_idle", "sw_power_cap"]
    assert power.read_samples(str(tmp_path / "missing.txt")) == []
    orphan = tmp_path / "orphan.txt"  # a parent that is gone: the loop stops before sampling
    assert power.sample_loop(lambda: (1.0, 1.0, 1.0, 1.0, 0), str(orphan), 0.0, max_samples=5,
                             parent_pid=os.getppid() + 1) == 0
    assert power.sample_loop(lambda: (1.0, 1.0, 1.0, 1.0, 0), str(orphan), 0.0, max_samples=2,
                             parent_pid=os.getppid()) == 2
    with pytest.raises(ValueError, match="power sampler mode 'nvidia-smi'"):
        power.PowerSampler(0, mode="nvidia-smi")
    off = power.PowerSampler(0, mode="off")
    with off:
        assert not off.active and off.window(0.0, 1e12) is None
    assert "off" in off.describe()


def test_power_process_sampler_reports_a_failed_child(monkeypatch):
    """Process mode runs ``python -m compare.power`` as a child; a child that cannot sample (no NVML on this
    machine) leaves no samples and says so in ``unavailable`` instead of failing the benchmark."""
    import time as _time

    s = power.PowerSampler(0, mode="process")
    monkeypatch.setattr(s, "_handle", object())  # pretend NVML answered in this process
    monkeypatch.setattr(s, "_nvml", None)
    monkeypatch.setattr(s, "unavailable", None)
    with s:
        assert s._child is not None
        s._child.wait(timeout=60)
        _time.sleep(0.05)
        assert s.window(0.0, 1e12) is None
        assert "sampling process exited with status" in (s.unavailable or "")
    assert s._child is None and s._file is None
