#!/usr/bin/env bash
# On the GPU machine: ncu throughput and warp-stall breakdown of one kernel of one suite shape.
#   bash benchmarks/profile.sh SHAPE_INDEX KERNEL_REGEX [IMPL] [fwd|fwdbwd]
#   (e.g. 0 forward_sm90; 0 triton_tem flex fwd for FlexAttention's forward kernel; SHAPE_INDEX
#   triN, e.g. tri768 triangle_output_kernel, profiles the triangle multiplication at N_res N)
set -u
shape=${1:-0}
kernel=${2:-forward_sm90}
impl=${3:-cutlass}
mode=${4:-fwdbwd}
if [[ "$shape" =~ ^tri([0-9]+)$ ]]; then
  target="--triangle ${BASH_REMATCH[1]} 0 cutlass"  # (the suite shape and impl are ignored)
else
  target="$shape $impl"
fi
stalls=""
for s in barrier long_scoreboard short_scoreboard mio_throttle math_pipe_throttle wait not_selected lg_throttle \
         dispatch_stall no_instruction branch_resolving tex_throttle selected; do
  stalls="$stalls,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio"
done
ncu --clock-control none --kernel-name "regex:${kernel}" --launch-skip 2 --launch-count 1 \
    --metrics "gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum.per_second,lts__t_sectors.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes.sum.per_second,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__block_size,launch__shared_mem_per_block_dynamic,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,sm__sass_inst_executed.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum${stalls}" \
    python3 benchmarks/one_step.py $target "$mode" 2>&1 | grep -E "^\s+(gpu__|sm__|smsp__|lts__|dram__|l1tex__|launch__)" \
    | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//; s/\s+/ /g'
