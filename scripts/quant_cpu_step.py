"""A GGUF in a float32 (or DTYPE) engine at one --quantization: 512-token prefill and the
batch-1 decode step in process CPU time at one thread, which the machine's load barely moves
(wall time on a shared 2-core box does). docs/quantization.md, "float32 engines at the file's bits".

    PYTHONPATH=. python scripts/quant_cpu_step.py MODEL auto|none [STEPS] [DTYPE]
"""

from __future__ import annotations

import json
import sys
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.common.model.quant import weight_format


def main() -> None:
    path, mode = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 24
    dtype = sys.argv[4] if len(sys.argv) > 4 else "float32"
    torch.set_num_threads(1)
    start = time.process_time()
    llm = LLM(path, dtype=dtype, quantization=mode)
    load = time.process_time() - start
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([list(range(5000, 5064))], one)  # warm-up
    prefill = []
    for k in range(3):  # distinct tokens: no prefix-cache hit between them
        start = time.process_time()
        llm.generate([list(range(100 + 600 * k, 612 + 600 * k))], one)
        prefill.append(time.process_time() - start)
    engine = llm.engine
    engine.add_request(
        "b1", [1, 2, 3, 4], SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    )
    engine.step()  # its prefill
    times = []
    while engine.has_unfinished:
        start = time.process_time()
        engine.step()
        times.append(time.process_time() - start)
    times.sort()
    print(
        json.dumps(
            {
                "mode": mode,
                "dtype": dtype,
                "weights": weight_format(engine.runner.model) or "float",
                "load_cpu_s": round(load, 2),
                "prefill512_cpu_s": [round(t, 3) for t in prefill],
                "prefill_tok_per_cpu_s": round(512 / min(prefill), 1),
                "decode_b1_cpu_ms_median": round(1000 * times[len(times) // 2], 1),
            }
        )
    )


if __name__ == "__main__":
    main()
