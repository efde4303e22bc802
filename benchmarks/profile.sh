#!/usr/bin/env bash
# On the GPU machine: ncu stall/throughput sections and the SASS opcode mix of the kernels of one
# suite shape (default 0). Writes to ${OUT:-/tmp}/.
set -u
shape=${1:-0}
out=${OUT:-/tmp}
for kernel in forward_kernel backward_dkdv_kernel backward_dq_kernel; do
  ncu --clock-control none --kernel-name "regex:${kernel}" --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      python3 benchmarks/one_step.py "$shape" > "$out/ncu_${kernel}.txt" 2>&1
  grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Block Limit|Eligible Warps|L2 Hit|Shared Memory Configuration Size|Dynamic Shared" "$out/ncu_${kernel}.txt" | sed "s/^/${kernel}: /"
done
so=$(ls .gpu-build/torch_extensions/*/*.so | head -1)
cuobjdump -sass "$so" > "$out/all.sass" 2>/dev/null
python3 - "$out/all.sass" <<'PY'
import re, sys, collections
text = open(sys.argv[1]).read()
for fn in re.findall(r"Function : (\S+)", text):
    if "bfloat16" not in fn or "Li32ELi1E" not in fn:
        continue
    body = text.split("Function : " + fn, 1)[1].split("Function : ", 1)[0]
    ops = collections.Counter(m.split(".")[0] for m in re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", body))
    print(fn[:90], sum(ops.values()), "instructions:", ", ".join(f"{k} {v}" for k, v in ops.most_common(18)))
PY
