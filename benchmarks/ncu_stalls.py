"""What a kernel waits on: Nsight Compute (ncu) on one launch of a command, its warp-stall reasons and
the SASS lines where its warps stall most (ncu's source counters). A timing says how long a kernel
takes; this says why, when the bytes it reads do not explain it.

    from benchmarks import ncu_stalls
    report = ncu_stalls.profile([sys.executable, "-m", ...], "paged_decode_kernel", out_base)

ncu replays the launch once per metric pass with the clocks left alone (`--clock-control none`): its
durations are not timings. A stall ratio is the warps stalled for that reason per issued instruction
(`smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio`): long_scoreboard waits on global
or local memory, short_scoreboard on shared memory, barrier on a block-wide sync, wait on a fixed
latency, math_pipe_throttle and mio_throttle on a busy pipe or queue, not_selected on a free slot taken
by another warp (not a stall of the kernel's making).
"""
import csv
import io
import shutil
import subprocess

STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"
METRICS = ["gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
           "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
           "launch__occupancy_limit_registers", "smsp__inst_executed.sum",
           f"regex:{STALL_PREFIX}.*_per_issue_active"]
SECTIONS = ["SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "SourceCounters"]


def available() -> bool:
    return shutil.which("ncu") is not None


def _csv_rows(text):
    """The CSV part of ncu's output (it may print ==PROF== lines before it)."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    return list(csv.reader(io.StringIO("\n".join(lines))))


def _number(value):
    try:
        return float(value.replace(",", ""))
    except (AttributeError, ValueError):
        return value


def parse_raw(text) -> dict:
    """`ncu --import R --page raw --csv`: a header row of metric names, a row of units, a row per
    kernel; the first kernel's values by name (numbers as floats)."""
    rows = _csv_rows(text)
    header = next((i for i, row in enumerate(rows) if "Kernel Name" in row), None)
    if header is None or len(rows) < header + 3:
        return {}
    return {name: _number(value) for name, value in zip(rows[header], rows[header + 2])}


def stall_ratios(metrics: dict) -> dict:
    """{reason: warps stalled per issued instruction}, largest first."""
    ratios = {name[len(STALL_PREFIX):-len(STALL_SUFFIX)]: value for name, value in metrics.items()
              if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX) and isinstance(value, float)}
    return dict(sorted(ratios.items(), key=lambda item: -item[1]))


def top_stall_lines(text, count=12) -> list:
    """`ncu --import R --page source --csv --print-source sass`: the SASS lines with the most warp-stall
    samples, as (address, instruction, samples, share of all samples)."""
    rows = _csv_rows(text)
    header = next((i for i, row in enumerate(rows) if any("Stall Sampling (All" in cell for cell in row)), None)
    if header is None:
        return []
    names = rows[header]
    samples = next(i for i, name in enumerate(names) if "Stall Sampling (All" in name)
    source = next((i for i, name in enumerate(names) if name.strip() == "Source"), 1)
    address = next((i for i, name in enumerate(names) if "Address" in name), 0)
    lines = [(row[address], row[source].strip(), _number(row[samples])) for row in rows[header + 1:]
             if len(row) == len(names) and isinstance(_number(row[samples]), float)]
    total = sum(n for _, _, n in lines) or 1.0
    lines.sort(key=lambda line: -line[2])
    return [(a, s, n, n / total) for a, s, n in lines[:count]]


def profile(command, kernel_regex, out_base, launch_skip=2, timeout=600) -> dict:
    """ncu on the launch after `launch_skip` launches of kernels matching kernel_regex in `command`
    (a list); the report and its two CSV pages are kept beside out_base. Raises RuntimeError if ncu
    is missing or fails (its output's tail in the message)."""
    if not available():
        raise RuntimeError("ncu (Nsight Compute) is not on PATH")
    report = f"{out_base}.ncu-rep"
    cmd = ["ncu", "--clock-control", "none", "--target-processes", "all", "-k", f"regex:{kernel_regex}",
           "--launch-skip", str(launch_skip), "--launch-count", "1", "-f", "-o", str(out_base)]
    for section in SECTIONS:
        cmd += ["--section", section]
    cmd += ["--metrics", ",".join(METRICS), *command]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0:
        raise RuntimeError(f"ncu exited {run.returncode}: {(run.stdout + run.stderr)[-3000:]}")
    pages = {}
    for page, extra in (("raw", []), ("source", ["--print-source", "sass"])):
        out = subprocess.run(["ncu", "--import", report, "--page", page, "--csv", *extra], capture_output=True,
                             text=True, timeout=timeout)
        pages[page] = out.stdout
        with open(f"{out_base}_{page}.csv", "w") as f:
            f.write(out.stdout + out.stderr)
    metrics = parse_raw(pages["raw"])
    return {"metrics": {name: value for name, value in metrics.items()
                        if name in METRICS or name.startswith(STALL_PREFIX)},
            "stalls": stall_ratios(metrics), "top_lines": top_stall_lines(pages["source"])}
