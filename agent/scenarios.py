"""Four scripted agent sessions: their input files (made here, deterministic) and the
conversation a model would have, for the offline Messages API server.

Used by ``sandkernel demo`` (the sales scenario, when no API key is set), by the test suite (all
of them, end to end through the real SDK, gateway and containers) and by bench/agent_roundtrips.py.
The code in the scripts is what a model writes; it runs for real in the sandbox.
"""

from __future__ import annotations

import codecs
import csv
import dataclasses
import datetime as dt
import io
import random
from collections.abc import Callable
from pathlib import Path

from sandkernel.agent.offline_api import (
    ScriptedTurn,
    call,
    result_contains,
    result_has_image,
    result_is_error,
    say,
)


@dataclasses.dataclass
class Scenario:
    name: str
    task: str
    make_files: Callable[[Path], list[Path]]  # writes the inputs under a directory, returns what to upload
    turns: Callable[[], list[ScriptedTurn]]
    # The execution policy (TOML) the gateway must run with for the script to hold; None: none.
    exec_policy: str | None = None


# -- sales: a CSV → quarterly totals and average order value → report.png -------------------

SALES_ROWS = 1200


def sales_rows() -> list[dict[str, str]]:
    rng = random.Random(2025)
    start = dt.date(2025, 1, 1)
    rows = []
    for order_id in range(1, SALES_ROWS + 1):
        day = start + dt.timedelta(days=rng.randrange(365))
        season = 1.0 + 0.25 * ((day.month - 1) // 3)  # later quarters sell more
        rows.append(
            {
                "order_id": str(order_id),
                "date": day.isoformat(),
                "region": rng.choice(["north", "south", "east", "west"]),
                "amount": f"{rng.gammavariate(2.0, 40.0) * season:.2f}",
            }
        )
    return rows


def sales_by_quarter() -> dict[str, dict[str, float]]:
    """The right answer, computed on the host without pandas: {"2025Q1": {"total", "avg_order_value"}}."""
    sums: dict[str, list[float]] = {}
    for row in sales_rows():
        day = dt.date.fromisoformat(row["date"])
        sums.setdefault(f"{day.year}Q{(day.month - 1) // 3 + 1}", []).append(float(row["amount"]))
    return {
        quarter: {"total": round(sum(amounts), 2), "avg_order_value": round(sum(amounts) / len(amounts), 2)}
        for quarter, amounts in sorted(sums.items())
    }


def make_sales_files(directory: Path) -> list[Path]:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["order_id", "date", "region", "amount"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(sales_rows())
    path = directory / "sales.csv"
    path.write_text(buffer.getvalue())
    return [path]


SALES_TASK = (
    "sales.csv holds a year of orders (order_id, date, region, amount). Compute the total sales and the "
    "average order value per quarter, draw a line chart of the quarterly totals and a bar chart of the "
    "average order value, save both in report.png, and tell me which quarter was best."
)


def sales_turns() -> list[ScriptedTurn]:
    answer = sales_by_quarter()
    best = max(answer, key=lambda q: answer[q]["total"])
    table = "\n".join(f"| {q} | {v['total']:,.2f} | {v['avg_order_value']:,.2f} |" for q, v in answer.items())
    return [
        ScriptedTurn(
            [
                say("I'll load the orders and check what the data looks like."),
                call(
                    "run_python",
                    code='import pandas as pd\nsales = pd.read_csv("sales.csv", parse_dates=["date"])\n'
                    "print(sales.shape)\nsales.head()",
                ),
            ]
        ),
        ScriptedTurn(
            [
                say("1200 orders over 2025. Now the per-quarter totals and average order value."),
                call(
                    "run_python",
                    code='sales["quarter"] = sales["date"].dt.to_period("Q").astype(str)\n'
                    'by_quarter = sales.groupby("quarter")["amount"].agg(\n'
                    '    total="sum", orders="count", avg_order_value="mean").round(2)\n'
                    "print(by_quarter.to_string())",
                ),
            ],
            expect=[result_contains(f"({SALES_ROWS}, 4)")],
        ),
        ScriptedTurn(
            [
                say("The aggregates look right. Drawing both charts into one figure."),
                call(
                    "run_python",
                    code="import matplotlib.pyplot as plt\n"
                    "fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))\n"
                    'by_quarter["total"].plot(ax=left, marker="o", title="Total sales per quarter")\n'
                    'by_quarter["avg_order_value"].plot(kind="bar", ax=right, color="#4c72b0",\n'
                    '                                   title="Average order value")\n'
                    'fig.tight_layout()\nfig.savefig("report.png", dpi=100)\nplt.show()',
                ),
            ],
            expect=[result_contains("avg_order_value"), result_contains("2025Q4")],
        ),
        ScriptedTurn(
            [
                call(
                    "final_answer",
                    answer=f"Per-quarter sales (report.png has both charts):\n\n| quarter | total | average order |\n"
                    f"|---|---|---|\n{table}\n\nThe best quarter was **{best}** "
                    f"with {answer[best]['total']:,.2f} in sales.",
                )
            ],
            expect=[result_has_image],
        ),
    ]


# -- logs: mixed encodings → ERROR lines per file → error_summary.csv -----------------------

LOG_FILES = {  # name: (encoding, number of ERROR lines)
    "api.log": ("utf-8", 3),
    "billing.log": ("latin-1", 2),
    "legacy.log": ("cp1252", 4),
    "worker.log": ("utf-16", 1),
}


def log_text(name: str, errors: int) -> str:
    rng = random.Random(name)
    words = ["café payé", "naïve retry", "€ rounding", "Größe", "timeout", "queue full"]
    levels = ["ERROR"] * errors + ["INFO"] * (errors * 3 + 2) + ["WARN"] * 2
    rng.shuffle(levels)
    return "".join(
        f"2025-06-{i + 1:02d} 12:{i:02d}:00 {level} {rng.choice(words)} in {name}\n" for i, level in enumerate(levels)
    )


def make_log_files(directory: Path) -> list[Path]:
    folder = directory / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    for name, (encoding, errors) in LOG_FILES.items():
        text = log_text(name, errors)
        data = (
            codecs.BOM_UTF16_LE + text.encode("utf-16-le")
            if encoding == "utf-16"
            else text.encode(encoding, errors="replace")
        )
        (folder / name).write_bytes(data)
    return [folder]


LOGS_TASK = (
    "The logs/ folder holds .log files from several systems, written in mixed encodings. Count the ERROR "
    "lines in each file and save the counts as error_summary.csv with columns file, encoding, error_lines."
)

LOGS_FIRST_TRY = """from pathlib import Path
counts = {}
for path in sorted(Path("logs").glob("*.log")):
    with open(path) as handle:
        counts[path.name] = sum(line.split()[2:3] == ["ERROR"] for line in handle)
counts"""

LOGS_SECOND_TRY = """import codecs, csv

def read_log(path):
    raw = path.read_bytes()
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return raw.decode("utf-16"), "utf-16"
    for encoding in ("utf-8", "cp1252", "latin-1"):
        try:
            return raw.decode(encoding), encoding
        except UnicodeDecodeError:
            continue

rows = []
for path in sorted(Path("logs").glob("*.log")):
    text, encoding = read_log(path)
    errors = sum(line.split()[2:3] == ["ERROR"] for line in text.splitlines())
    rows.append({"file": path.name, "encoding": encoding, "error_lines": errors})

with open("error_summary.csv", "w", newline="") as out:
    writer = csv.DictWriter(out, fieldnames=["file", "encoding", "error_lines"])
    writer.writeheader()
    writer.writerows(rows)
print(open("error_summary.csv").read())"""


def logs_turns() -> list[ScriptedTurn]:
    summary = ", ".join(f"{name}: {errors}" for name, (_, errors) in LOG_FILES.items())
    return [
        ScriptedTurn([say("I'll count ERROR lines per file."), call("run_python", code=LOGS_FIRST_TRY)]),
        ScriptedTurn(
            [
                say(
                    "Some files are not UTF-8. I'll detect each file's encoding: a BOM means UTF-16, "
                    "otherwise try UTF-8, then cp1252, then latin-1."
                ),
                call("run_python", code=LOGS_SECOND_TRY),
            ],
            expect=[result_is_error(), result_contains("UnicodeDecodeError")],
        ),
        ScriptedTurn(
            [call("final_answer", answer=f"ERROR lines per file: {summary}. Saved as error_summary.csv.")],
            expect=[result_is_error(False), result_contains("error_lines")],
        ),
    ]


# -- network: code that tries to fetch a URL gets a clear error; the agent reports it ---------

NETWORK_URL = "http://sales-data.example.invalid/q4.csv"  # RFC 6761: .invalid never resolves
NETWORK_TASK = f"Download the Q4 sales file from {NETWORK_URL} and tell me its total."


def network_turns() -> list[ScriptedTurn]:
    fetch = (
        "import urllib.request\n"
        "with urllib.request.urlopen({url!r}, timeout=10) as response:\n"
        "    data = response.read()\n"
        "len(data)"
    )
    return [
        ScriptedTurn([say("Fetching the file."), call("run_python", code=fetch.format(url=NETWORK_URL))]),
        ScriptedTurn(
            [
                say("That failed; maybe a transient problem. Trying HTTPS."),
                call("run_python", code=fetch.format(url=NETWORK_URL.replace("http:", "https:"))),
            ],
            expect=[result_is_error(), result_contains("URLError")],
        ),
        ScriptedTurn(
            [
                call(
                    "final_answer",
                    answer="I could not download the file: the sandbox has no network access (both attempts "
                    "failed with URLError). Please upload q4.csv and I will compute its total.",
                )
            ],
            expect=[result_contains("Stop repeating that approach")],
        ),
    ]


# -- policy: the gateway's execution policy refuses the first code; the model rewrites it -----

POLICY_FILES = {"orders.csv": 41, "returns.csv": 7}  # name -> lines, header included
POLICY_TASK = "How many lines does each CSV file in the workspace have? Save the counts in line_counts.csv."
POLICY_TOML = """# The operator's policy for the policy scenario: no programs started from Python.
default = "allow"

[rules.subprocess]
action = "deny"

[rules.shell]
action = "warn"
"""
POLICY_FIRST_TRY = """import subprocess
out = subprocess.run(["wc", "-l", "orders.csv", "returns.csv"], capture_output=True, text=True)
print(out.stdout)"""
POLICY_SECOND_TRY = """from pathlib import Path
import csv

counts = {path.name: sum(1 for _ in path.open()) for path in sorted(Path(".").glob("*.csv"))
          if path.name != "line_counts.csv"}
with open("line_counts.csv", "w", newline="") as out:
    writer = csv.writer(out)
    writer.writerow(["file", "lines"])
    writer.writerows(counts.items())
print(open("line_counts.csv").read())"""


def make_policy_files(directory: Path) -> list[Path]:
    made = []
    for name, lines in POLICY_FILES.items():
        path = directory / name
        path.write_text("id,value\n" + "".join(f"{i},{i * 3}\n" for i in range(1, lines)))
        made.append(path)
    return made


def policy_turns() -> list[ScriptedTurn]:
    counts = ", ".join(f"{name}: {lines}" for name, lines in POLICY_FILES.items())
    return [
        ScriptedTurn([say("I'll count the lines with wc."), call("run_python", code=POLICY_FIRST_TRY)]),
        ScriptedTurn(
            [
                say("The sandbox's policy refuses starting programs; I'll count the lines in Python instead."),
                call("run_python", code=POLICY_SECOND_TRY),
            ],
            expect=[result_is_error(), result_contains("rule subprocess, line 1"), result_contains("NOT run")],
        ),
        ScriptedTurn(
            [call("final_answer", answer=f"Lines per file: {counts}. Saved as line_counts.csv.")],
            expect=[
                result_is_error(False),
                *(result_contains(f"{name},{lines}") for name, lines in POLICY_FILES.items()),
            ],
        ),
    ]


SCENARIOS = {
    "sales": Scenario("sales", SALES_TASK, make_sales_files, sales_turns),
    "logs": Scenario("logs", LOGS_TASK, make_log_files, logs_turns),
    "network": Scenario("network", NETWORK_TASK, lambda directory: [], network_turns),
    "policy": Scenario("policy", POLICY_TASK, make_policy_files, policy_turns, exec_policy=POLICY_TOML),
}
