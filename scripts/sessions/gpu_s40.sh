#!/usr/bin/env bash
# GPU calls planned in sessions 39 and 40 (session 40 was lent no GPU) for the next session (one GPU).
# PART a: issue 6's accuracy item over three seeds with today's kernels. Session 39 ran seed 42 (bf16 / fp8 / fp8_bwd)
#   and seed 7 (bf16 / fp8_bwd): fp8_bwd +2.04 % of bf16 (seed 42 +3.7 % after a loss spike at step 61). Here seed
#   123 in all three precisions, then seed 7 fp8; compare.loss_spread then combines all five records (on any machine).
#   Then seed 42 fp8_bwd with the bf16 weight gradients (FP8_WGRAD=bf16): session 39's fp8_bwd runs had grad-norm
#   spikes (12.7 / 19.5 / 11.7 at steps 30 / 61 / 63, seed 42; 21.3 at step 33, seed 7) where bf16 peaked at 5.4;
#   if they vanish with bf16 wgrads, the FP8 wgrads are where to look (scripts/fp8_recipe_error.py: bf16 wgrads take dw2's
#   error from 3.3 % to 0.17 % but dw1 / dw3's only from 5.0 % to 3.7 %, the FP8 dgrad's share).
# PART b: the FP8 quantizers' tests on CUDA and the A/B of the expert weights' FP8 copies (the transposed copy now
#   stored by the quantizing kernel: PyTorch's strided copy of the e4m3 tensor took 4.1 of 4.7 ms a step at 30B);
#   the FP8 wgrad's GPU tests and A/B with session 40's m64n128 consumer (Fp8WgradConfig.mma_n).
# PART c: the FP8 GEMM GPU tests after the scale prefetch's removal (PTX unchanged) and the fused FP8 node against
#   the modular op at the 30B dims (training runs the node; its gradients had only a finite check on the GPU); the
#   30B layer with the FP8 weight copies made in every step (compare.layer --fp8-weights-per-step, as training
#   makes them); compare.profile of the 30B fp8 step.
# PART d: the 235B layer in every precision beside stock compiled with h quantized in GEMM1 at every D (README's
#   235B fp8 rows predate it; the first numerics_vs_bf16 at a real shape); Nsight Compute on the FP8 wgrads at 30B.
# Call as: REV=<hash> PART=a|b|c|d [BUDGET=seconds] bash scripts/sessions/gpu_s40.sh (carry .whl; see scripts/gpu_env.sh)
source scripts/gpu_env.sh
session_start
if [ "$PART" = a ]; then
  debug_train_seed a 123 bf16 fp8 fp8_bwd
  [ "$(left 200)" -ge 100 ] && debug_train_seed a 7 fp8
  [ "$(left 200)" -ge 100 ] && TITAN_MEGAMOE_FP8_WGRAD=bf16 LABEL_SUFFIX=-wgrad_bf16 debug_train_seed a_wgrad_bf16 42 fp8_bwd
fi
if [ "$PART" = b ]; then
  gpu_tests quant_b tests/test_fp8_quant.py  # the transposed weight copy stored by the quantizing kernel, on CUDA
  ab_groups wq_b fp8_weight_quant  # that copy against PyTorch's strided copy
  wgrad_fp8_tests_ab b  # the m64n128 consumer: bitwise the default, then the A/B
fi
if [ "$PART" = c ]; then
  gpu_tests fp8_c tests/test_ws_gemm_fp8.py tests/test_eager_layer.py -k gpu
  # the weight copies in every step, as training makes them; with FP8_WEIGHT_T_KERNEL=0 the path before, same process
  LAYER_FLAGS=--fp8-weights-per-step layer_ab 30b_wq_c FP8_WEIGHT_T_KERNEL=0 qwen3-30b-a3b bf16,fp8,fp8_bwd \
    tt-compile,megamoe-triton 12
  [ "$(left 100)" -ge 60 ] && prof 30b_fp8_c qwen3-30b-a3b fp8  # where the 30B fp8 step goes now (session 33's is stale)
fi
if [ "$PART" = d ]; then
  layer_ab 235b_d "" qwen3-235b-a22b bf16,fp8,fp8_bwd tt-compile,megamoe-triton 12
  [ "$(left 200)" -ge 90 ] && ncu_wgrad d 30b
fi
(cd "$OUT/keep" && tar czf "logs_keep_$PART.tgz" *.log 2>/dev/null && rm -f *.log)  # few files come back
session_pack "s40$PART"
