"""Re-record the example transcripts from real sandboxed sessions.

    python notebooks/examples/record_examples.py

sales-demo.ipynb is the README demo (``sandkernel demo``: the agent's sales scenario, scripted
offline when ANTHROPIC_API_KEY is unset); error-recovery.ipynb is an agent-style session that hits
an error, reads the traceback and fixes it. The test suite replays both.
"""

from __future__ import annotations

import asyncio
import platform
import tempfile
from pathlib import Path

from sandkernel.demo import run_demo
from sandkernel.kernels.execution.session import KernelSession
from sandkernel.notebooks.observer import attach_transcript
from sandkernel.notebooks.recorder import TranscriptRecorder

HERE = Path(__file__).parent

RECOVERY_STEPS = [
    (
        "Write a small inventory file to work on.",
        "rows = ['sku,qty,price', 'A-1,4,2.50', 'B-2,10,1.25', 'C-3,0,9.99']\n"
        "open('inventory.csv', 'w').write('\\n'.join(rows) + '\\n')\nprint(open('inventory.csv').read())",
    ),
    ("First attempt: a typo in the module name.", "import pandsa as pd"),
    (
        "The traceback says the module does not exist; fix the import.",
        "import pandas as pd\ninventory = pd.read_csv('inventory.csv')\ninventory",
    ),
    (
        "Stock value per SKU and the total.",
        "inventory['value'] = inventory.qty * inventory.price\n"
        "print(inventory[['sku', 'value']].to_string(index=False))\n"
        "print('total:', inventory.value.sum())",
    ),
]


async def record_recovery(path: Path) -> None:
    recorder = TranscriptRecorder(path, {"host": platform.node(), "purpose": "example: error and recovery"})
    async with await KernelSession.start() as session:
        await attach_transcript(session, recorder)
        for note, code in RECOVERY_STEPS:
            await recorder.add_markdown(note)
            await session.execute(code, timeout=120, tag=f"step-{RECOVERY_STEPS.index((note, code)) + 1}", source="cli")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as workdir:
        run_demo(HERE / "sales-demo.ipynb", workdir=Path(workdir))
    asyncio.run(record_recovery(HERE / "error-recovery.ipynb"))
    print("recorded", sorted(p.name for p in HERE.glob("*.ipynb")))
