"""What ``torch.autocast`` does to each aten op, one table per device.

PyTorch decides per op, not per model, and per device: an op registered under
the ``AutocastCUDA`` (``AutocastCPU``) dispatch key is run with its floating
inputs cast by a *cast policy*; every other op falls through and runs in its
inputs' dtypes. The policies (``CastPolicy`` in ``aten/src/ATen/autocast_mode.h``):

- ``lower_precision_fp``: cast to autocast's half dtype (``Ctx.act``), float32
  leaf weights through the weight cache;
- ``fp32``: cast to float32;
- ``fp32_set_opt_dtype``: run in float32 by setting the op's ``dtype=`` argument
  (softmax, log_softmax, sum, ...): the input is not copied, the output is float32;
- ``fp32_append_dtype``: ``norm`` redispatched with a float32 output dtype;
- ``promote``: the widest floating dtype among the inputs;
- ``banned``: raises (``binary_cross_entropy`` on CUDA).

Source, PyTorch 2.13 (the version the tests run against):

- CUDA: ``aten/src/ATen/autocast_mode.cpp``, ``TORCH_LIBRARY_IMPL(aten, Autocast, m)``
  (the ``AutocastCUDA`` key), which registers the lists of
  ``aten/src/ATen/autocast_mode.h``: ``AT_FORALL_LOWER_PRECISION_FP`` (plus
  ``cudnn_convolution`` and ``cudnn_convolution_transpose``, registered in the .cpp),
  ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``,
  ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`` (fp32_append_dtype) and
  ``AT_FORALL_PROMOTE``; ``binary_cross_entropy`` is banned.
- CPU: ``aten/src/ATen/autocast_mode.cpp``, ``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)``,
  its own ``KERNEL_CPU`` lists under "lower_precision_fp cast policy", "fp32 cast
  policy" and "promote". (Older sources also list the Dimname overloads
  ``prod.dim_Dimname`` and ``index_copy.dimname``; 2.13 registers neither.)

``tests/test_rules.py`` pins both tables, op for op, against the registrations of the
installed PyTorch (``torch._C._dispatch_get_registrations_for_dispatch_key``), and the
CPU table against what the ops really return under CPU autocast.

The ops our rules run, and what autocast does to them (``-``: falls through)::

    rule         aten op                CUDA                 CPU
    linear       linear, addmm          lower_precision_fp   lower_precision_fp
    matmul       matmul                 lower_precision_fp   lower_precision_fp
    layer_norm   layer_norm             fp32                 -
    softmax      softmax.int            fp32_set_opt_dtype   -
    log_softmax  log_softmax.int        fp32_set_opt_dtype   -
    gelu_new     pow.Tensor_Scalar      fp32                 -
    nll_loss     nll_loss               fp32                 fp32
    (cross_entropy_loss, not a rule)    -                    fp32
    embedding, gelu, relu, dropout, add, mul, tanh:  -       -

Names are aten schema names, with the overload after a dot as in the sources
(``pow.Tensor_Scalar``); a rule asks :meth:`symmem.rules.Ctx.autocast_dtype`.
"""
from __future__ import annotations

from types import MappingProxyType

from ..errors import UnknownName

__all__ = ["AUTOCAST", "CAST_POLICIES", "autocast_policy"]

CAST_POLICIES = ("lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype",
                 "promote", "banned")

_CUDA = {
    "lower_precision_fp": """
        _convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc
        conv_transpose1d conv_transpose2d.input conv_transpose3d.input convolution prelu
        addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm
        chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell
        lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
        _scaled_dot_product_flash_attention scaled_dot_product_attention
        cudnn_convolution cudnn_convolution_transpose
    """,
    "fp32": """
        acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan
        pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm
        native_layer_norm rms_norm group_norm frobenius_norm.dim nuclear_norm
        nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss
        nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss
        huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
        triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist
        pdist cdist renorm logsumexp upsample_nearest1d _upsample_nearest_exact1d
        upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d
        _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d
        _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d
        _upsample_bicubic2d_aa
    """,
    "fp32_set_opt_dtype": """
        prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm
        linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList
    """,
    "fp32_append_dtype": """
        norm.Scalar norm.ScalarOpt_dim
    """,
    "promote": """
        addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot
        scatter_add
    """,
    "banned": """
        binary_cross_entropy
    """,
}

_CPU = {
    "lower_precision_fp": """
        conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding bmm mm
        linalg_vecdot baddbmm addmm _addmm_activation addbmm linear
        _convolution.deprecated matmul conv_tbc mkldnn_rnn_layer conv_transpose1d
        conv_transpose2d.input conv_transpose3d.input prelu scaled_dot_product_attention
        _native_multi_head_attention
    """,
    "fp32": """
        avg_pool3d binary_cross_entropy grid_sampler polar prod prod.dim_int quantile
        quantile.scalar nanquantile nanquantile.scalar stft stft.center cdist
        grid_sampler_2d _grid_sampler_2d_cpu_fallback grid_sampler_3d trace
        view_as_complex cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr
        ormqr pinverse max_pool3d max_unpool2d max_unpool3d adaptive_avg_pool3d
        reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d
        replication_pad3d mse_loss cosine_embedding_loss nll_loss nll_loss2d
        hinge_embedding_loss poisson_nll_loss smooth_l1_loss cross_entropy_loss l1_loss
        huber_loss margin_ranking_loss soft_margin_loss triplet_margin_loss
        multi_margin_loss ctc_loss.IntList ctc_loss.Tensor kl_div multilabel_margin_loss
        binary_cross_entropy_with_logits fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn
        fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn fft_hfft
        fft_ihfft linalg_cond linalg_cond.p_str linalg_matrix_rank
        linalg_matrix_rank.tol_tensor linalg_matrix_rank.atol_rtol_tensor
        linalg_matrix_rank.atol_rtol_float linalg_solve linalg_cholesky linalg_svdvals
        linalg_eigvals linalg_eigvalsh linalg_inv linalg_householder_product
        linalg_tensorinv linalg_tensorsolve fake_quantize_per_tensor_affine geqrf
        _lu_with_info qr svd triangular_solve fractional_max_pool2d
        fractional_max_pool3d adaptive_max_pool3d multilabel_margin_loss_forward
        linalg_qr linalg_cholesky_ex linalg_svd linalg_eig linalg_eigh linalg_lstsq
        linalg_inv_ex
    """,
    "promote": """
        stack cat index_copy
    """,
}


def _table(lists: dict) -> MappingProxyType:
    """{policy: "names ..."} -> a read-only {aten op: policy}; an op is in one list only."""
    out: dict[str, str] = {}
    for policy, names in lists.items():
        assert policy in CAST_POLICIES, policy
        for name in names.split():
            assert name not in out, f"{name} is in both {out[name]} and {policy}"
            out[name] = policy
    return MappingProxyType(out)


#: device -> {aten op: cast policy}; an op that is absent falls through (runs as given).
AUTOCAST = MappingProxyType({"cuda": _table(_CUDA), "cpu": _table(_CPU)})


def autocast_policy(device: str, op: str) -> str | None:
    """The cast policy ``torch.autocast`` applies to aten ``op`` on ``device``, or None
    when the op falls through (autocast leaves it alone)."""
    try:
        table = AUTOCAST[device]
    except KeyError:
        raise UnknownName("autocast device", device, tuple(AUTOCAST)) from None
    return table.get(op)
