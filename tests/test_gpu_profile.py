"""benchmarks/gpu_profile.py: the kernel classes of real kernel and operator names, time by range (innermost range
at launch), and one real CPU step profiled with the model's ranges."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

# CUDA kernel names as torch.profiler reports them for the kernels a bf16 training step of this project launches:
# cuBLAS (nvjet on Hopper, sm90 xmma, Ampere's s16816, CUTLASS, split-K reductions), PyTorch's flash attention,
# inductor's Triton kernels, ATen's eager kernels, NCCL. The first H200 run kept no kernel names (it had no
# profile), so these come from published torch.profiler / nsys tables of H100/H200 and A100 runs.
CUDA_KERNELS = {
    "nvjet_tst_128x256_64x6_2x1_2cta_v_bz_TNT": "gemm",
    "nvjet_tst_128x8_64x12_2x1_v_bz_splitK_TNT": "gemm",
    "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNN": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
    "__5x_cublas": "gemm",
    "ampere_bf16_s16816gemm_bf16_128x256_ldg8_f2f_stages_64x3_tn": "gemm",
    "ampere_sgemm_64x64_nt": "gemm",
    "void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_128x128_16x5_tn_align4>(T1::Params)": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, false, true, "
    "false>(cublasLt::cublasSplitKParams<float>, int const*, __nv_bfloat16 const*, __nv_bfloat16*)": "gemm",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false>": "gemm",
    "triton_tem_fused_mm_0": "gemm",
    "triton_tem_fused_flex_attention_0": "flex_attention",
    "triton_tem_fused_flex_attention_backward_2": "flex_attention",
    "triton_tem_fused_flex_attention_backward_mul_1": "flex_attention",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, "
    "Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, "
    "false>(pytorch_flash::Flash_fwd_params)": "sdpa_attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, "
    "2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> >, true, "
    "false, false, false, false, true, false>(pytorch_flash::Flash_bwd_params)": "sdpa_attention",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
    "cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)": "sdpa_attention",
    "triton_poi_fused_mul_silu_0": "inductor_fused",
    "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "inductor_fused",
    "triton_red_fused__to_copy_mean_pow_1": "inductor_fused",
    "triton_poi_fused__scaled_dot_product_flash_attention_add_mul_permute_stack_sub_unbind_view": "inductor_fused",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
    "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)": "softmax_ce",
    "void <unnamed>::softmax_warp_backward<c10::BFloat16, c10::BFloat16, float, (int)9, (bool)1, (bool)0>(T2 *, "
    "const T1 *, const T1 *, int, int, int, const bool *)": "softmax_ce",
    "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(float*, "
    "float*, float const*, long const*, float const*, bool, long, long, long, long)": "softmax_ce",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
    "namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
    "(at::native::ADAM_MODE)1, false>, bool, float, float, float, float, float, float, float*, float*, "
    "float*>(...)": "optimizer",
    "void at::native::<unnamed>::multi_tensor_apply_kernel<at::native::<unnamed>::TensorListMetadata<(int)2>, "
    "at::native::<unnamed>::UnaryOpFunctor<c10::BFloat16, (int)2, (int)1, (int)1>, "
    "at::native::Copy<c10::BFloat16, c10::BFloat16>>(T1, T2, T3...)": "optimizer",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "collective",
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "collective",
    "Memcpy HtoD (Pageable -> Device)": "memcpy",
    "Memset (Device)": "memcpy",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::"
    "{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, "
    "at::detail::Array<char*, 2>, TrivialOffsetCalculator<1, unsigned int>>(...)": "memcpy",
    "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)"
    "::{lambda(float)#1}, at::detail::Array<char*, 2> >(int, ...)": "memcpy",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>, "
    "unsigned int, 3, 64, 64>(...)": "memcpy",
    "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
    "at::native::binary_internal::MulFunctor<float> >, at::detail::Array<char*, 3> >(int, ...)": "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
    "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
    "unsigned int, float, 4> >(...)": "elementwise",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<...> >(long, ...)": "elementwise",
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, "
    "true>(...)": "elementwise",
}
# CPU operators with their own time in a profile of this project's step on CPU (tiny target, padded and packed
# batches, backward and AdamW; recorded with torch 2.13 for this test).
CPU_OPERATORS = {
    "aten::mm": "gemm", "aten::addmm": "gemm", "aten::matmul": "gemm", "aten::linear": "gemm",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "sdpa_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "sdpa_attention",
    "aten::scaled_dot_product_attention": "sdpa_attention",
    "## Call CompiledFxGraph f57ypykoi35sztoltbz2vml32agbmpoerk54vsedxtgrks7x4jhd ##": "inductor_fused",
    "aten::_log_softmax": "softmax_ce", "aten::_log_softmax_backward_data": "softmax_ce",
    "aten::nll_loss_forward": "softmax_ce", "aten::nll_loss_backward": "softmax_ce",
    "aten::_foreach_mul_": "optimizer", "aten::_fused_adamw_": "optimizer", "Optimizer.step#AdamW.step": "optimizer",
    "aten::copy_": "memcpy", "aten::_to_copy": "memcpy", "aten::cat": "memcpy", "aten::fill_": "memcpy",
    "aten::zeros": "memcpy", "aten::clone": "memcpy",
    "aten::mul": "elementwise", "aten::add": "elementwise", "aten::rsqrt": "elementwise", "aten::silu": "elementwise",
    "aten::embedding": "elementwise", "aten::index": "elementwise", "aten::linalg_vector_norm": "elementwise",
    "aten::lerp_": "elementwise", "aten::nonzero": "elementwise",
    "aten::empty": "other", "aten::empty_strided": "other", "aten::view": "other", "aten::as_strided": "other",
    "aten::transpose": "other", "aten::item": "other", "aten::split_with_sizes": "other",
    "autograd::engine::evaluate_function: MmBackward0": "other",
    "autograd::engine::evaluate_function: LogSoftmaxBackward0": "other",
    "autograd::engine::evaluate_function: IndexBackward0": "other",
    "torch::autograd::AccumulateGrad": "other", "MeanBackward1": "other", "TorchDynamo Cache Lookup": "other",
    "Torch-Compiled Region: 0/0": "other",
}


@pytest.fixture(scope="module")
def gpu_profile():
    spec = importlib.util.spec_from_file_location("gpu_profile", ROOT / "benchmarks" / "gpu_profile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_profile"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("names", [CUDA_KERNELS, CPU_OPERATORS], ids=["cuda_kernels", "cpu_operators"])
def test_kernel_classes_of_real_names(gpu_profile, names):
    wrong = {name[:90]: (gpu_profile.kernel_class(name), expected) for name, expected in names.items()
             if gpu_profile.kernel_class(name) != expected}
    assert not wrong, wrong
    assert set(names.values()) <= set(gpu_profile.KERNEL_CLASSES)


def test_time_goes_to_the_innermost_range_open_at_launch(gpu_profile):
    Kernel, Range = gpu_profile.Kernel, gpu_profile.Range
    ranges = [Range("forward_other", 0, 100), Range("target", 10, 40), Range("draft_forward", 50, 90),
              Range("backward", 100, 200)]
    kernels = [Kernel("nvjet_tst_a", 15, 30.0), Kernel("nvjet_tst_a", 60, 10.0), Kernel("triton_poi_fused_0", 45, 5.0),
               Kernel("ncclDevKernel_AllReduce", None, 15.0), Kernel("ampere_sgemm_64x64_nt", 150, 40.0)]
    out = gpu_profile.summarize_kernels(kernels, ranges)
    assert {k: v["ms"] for k, v in out["ranges"].items()} == {
        "target": 0.03, "draft_forward": 0.01, "forward_other": 0.005, "unattributed": 0.015, "backward": 0.04}
    assert {k: v["ms"] for k, v in out["classes"].items()} == {"gemm": 0.08, "collective": 0.015,
                                                               "inductor_fused": 0.005}
    assert out["total_ms"] == 0.1 and sum(v["share"] for v in out["classes"].values()) == pytest.approx(1.0)
    assert out["top"][0] == {"name": "nvjet_tst_a", "class": "gemm", "ms": 0.04, "calls": 2, "share": 0.4}


def tiny_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_lab.model.build import wrap_target

    config = Qwen3Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, intermediate_size=64, vocab_size=264, max_position_embeddings=256,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return wrap_target(Qwen3ForCausalLM(config).eval(), mask_token_id=3, block_size=4, loss_gamma=None,
                       anchors_per_doc=4, anchor_density=None, draft_layers=1, target_layer_ids=None,
                       draft_intermediate_size=64, draft_init_seed=0, draft_init_std=None, fixed_anchors=2,
                       compile_layers=False, activation_checkpointing=False)


def test_a_profiled_cpu_step_has_every_range_and_the_model_is_unwrapped_after(gpu_profile):
    from dflash_lab.data import collate_padded

    torch.set_num_threads(1)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=1e-3)
    lengths = [24, 16, 12]
    generator = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(8, 260, (n,), generator=generator),
                "loss_mask": torch.ones(n, dtype=torch.bool)} for n in lengths]
    batch = collate_padded(samples, [0, 1, 2], lengths, 0)

    def step():   # as benchmarks/gpu_check.py's step_body opens its ranges
        with torch.autograd.profiler.record_function("gpu_check.forward_other"):
            out = model(batch, torch.Generator().manual_seed(0))
        with torch.autograd.profiler.record_function("gpu_check.backward"):
            out.weighted_ce_sum.backward()
        with torch.autograd.profiler.record_function("gpu_check.optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    out = gpu_profile.profile_step(step, model, torch.device("cpu"))
    assert out["time_basis"] == "CPU operator self time" and 0 < out["total_ms"] <= out["wall_ms"]
    assert {"target", "draft_forward", "head", "fixed_anchors", "backward", "optimizer"} <= set(out["ranges"])
    assert {"gemm", "sdpa_attention", "softmax_ce", "elementwise"} <= set(out["classes"])
    assert out["ranges"].get("unattributed", {"ms": 0.0})["ms"] < 0.01 * out["total_ms"]
    assert not {"target_features", "_draft_blocks", "_head_ce", "_fixed_output"} & set(vars(model))
    assert "project_context" not in vars(model.draft)


def test_a_missing_model_method_is_named(gpu_profile):
    class NoHead(torch.nn.Module):
        draft = torch.nn.Module()

        def target_features(self):
            return None

    with pytest.raises(AttributeError, match="project_context"):
        with gpu_profile.model_ranges(NoHead()):
            pass


def test_cuda_kernels_are_placed_at_their_launch_and_range_spans_are_not_kernels(gpu_profile):
    """The CUDA path on hand-made profiler events: a kernel counts at its launching operator's (or annotation's)
    start; kineto's GPU-timeline span of a range is no kernel; a kernel no operator launched is unattributed."""
    from types import SimpleNamespace as Event

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Kernel

    def event(name, device, start, end, kernels=(), annotation=False):
        return Event(name=name, device_type=device, time_range=Event(start=start, end=end), kernels=list(kernels),
                     is_user_annotation=annotation, self_cpu_time_total=end - start)

    events = [
        event("gpu_check.target", DeviceType.CPU, 0, 50, annotation=True),
        event("aten::mm", DeviceType.CPU, 10, 12, [Kernel("nvjet_tst_x", 0, 30.0)]),
        event("## Call CompiledFxGraph abc ##", DeviceType.CPU, 20, 22, [Kernel("triton_poi_fused_0", 0, 5.0)],
              annotation=True),
        event("gpu_check.backward", DeviceType.CPU, 60, 100, annotation=True),
        event("aten::mm", DeviceType.CPU, 70, 71, [Kernel("nvjet_tst_x", 0, 40.0)]),
        event("gpu_check.target", DeviceType.CUDA, 15, 90, annotation=True),   # the range's span on the GPU
        event("nvjet_tst_x", DeviceType.CUDA, 15, 45), event("triton_poi_fused_0", DeviceType.CUDA, 45, 50),
        event("nvjet_tst_x", DeviceType.CUDA, 72, 112),
        event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", DeviceType.CUDA, 112, 132),   # launched by no operator
    ]
    kernels = gpu_profile.device_kernels(events)
    assert sorted((k.name, k.launch_us, k.duration_us) for k in kernels if k.launch_us is not None) == [
        ("nvjet_tst_x", 10, 30.0), ("nvjet_tst_x", 70, 40.0), ("triton_poi_fused_0", 20, 5.0)]
    out = gpu_profile.summarize_kernels(kernels, gpu_profile.profile_ranges(events))
    assert out["total_ms"] == 0.095 and "other" not in out["classes"]
    assert {k: v["ms"] for k, v in out["ranges"].items()} == {"target": 0.035, "backward": 0.04, "unattributed": 0.02}
