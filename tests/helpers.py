"""Checks shared by several test files."""
import sympy as sp

from symmem.symbols import L


def assert_repeat_matches_unrolled(rep, unr, n, points=((1, 1), (3, 7), (64, 2048))):
    """The estimate of a graph with a repeat of L equals that of the graph unrolled to n
    iterations: every component symbolically at L = n, the peak at each (b, s)."""
    for name, expr in rep.components.items():
        assert sp.expand(expr.subs(L, n) - unr.components[name]) == 0, name
    for bb, ss in points:
        assert rep.at(b=bb, s=ss, L=n).peak == unr.at(b=bb, s=ss).peak, (bb, ss)


def assert_step_exact(est, report, b, s):
    """A training step measured by ``symmem.measure.training_step`` against the estimate at
    (b, s): the peak, the phase it is in, and each phase's own maximum, to the byte (the
    formula must not be right only at the binding point)."""
    ev = est.at(b=b, s=s)
    subs = est._subs({"b": b, "s": s})
    predicted = {phase: max(int(p.total.xreplace(subs)) for p in est.timeline if p.phase == phase)
                 for phase in report.phase_peaks}
    assert (predicted, ev.peak) == (report.phase_peaks, report.peak), \
        (ev.peak_point.where, report.peak_phase, report.peak_op)
    assert ev.peak_point.phase == report.peak_phase


def assert_hf_step_exact(est, model, ids, precision, opt, b, s, impl="for-loop", params=None):
    """A Hugging Face causal LM trained on ``ids`` (``labels=ids``; bfloat16 autocast for
    ``bf16-mixed``) against ``est`` at (b, s): the bytes saved for backward, then the whole
    training step (:func:`assert_step_exact`) with ``opt`` in ``impl`` over ``params`` (every
    parameter by default)."""
    import torch
    from symmem.measure import saved_bytes, training_step
    from test_gpt2_measured import optimizer

    def fwd():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            return model(ids, labels=ids).loss
    assert est.at(b=b, s=s).bytes["activations"] == saved_bytes(fwd, exclude=model).total
    report = training_step(model, lambda m: fwd(), optimizer(opt, impl, params or model.parameters()), extra=(ids,))
    assert_step_exact(est, report, b, s)


def enable_checkpointing(model, **kwargs):
    """transformers' activation checkpointing of every layer, with ``kwargs`` for
    ``torch.utils.checkpoint`` (none: its default, ``use_reentrant=False``). transformers 5.24
    names it ``activation_checkpointing_enable`` and deprecates ``gradient_checkpointing_enable``,
    the only name of earlier versions."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        return enable(activation_checkpointing_kwargs=kwargs or None)
    return model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


def saved_as_cuda_on_meta(model, call, kernel):
    """The bytes autograd saves in ``call(model)`` (a training forward of a model built on
    PyTorch's meta device: shapes and dtypes, no data) as CUDA runs it, each distinct storage
    once, the model's weights and buffers excluded. What the CPU would do differently is put
    as CUDA does it: ``F.scaled_dot_product_attention`` calls ``kernel``'s aten op (flash,
    mem-efficient or cudnn; a float mask expanded to the batch first, as ``attention.cpp``'s
    ``preprocess_mask`` does for mem-efficient), whose meta function and autograd formula are
    PyTorch's own; ``F.dropout`` is ``native_dropout`` (a bool mask; on the CPU and meta devices
    ``F.dropout`` saves a float one); transformers' check for packed sequences, which reads the
    position ids' values, is skipped (no packing). The philox seed and offset of the
    mem-efficient kernel are counted here (16 bytes a call) where CUDA keeps them on the host."""
    import torch
    import transformers.masking_utils as masking
    f = torch.nn.functional
    ops = torch.ops.aten

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if kernel == "flash" and attn_mask is None:
            return ops._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        if kernel == "cudnn" and attn_mask is None:
            return ops._scaled_dot_product_cudnn_attention(q, k, v, None, True, dropout_p, is_causal, False,
                                                           scale=scale)[0]
        assert kernel == "mem-efficient", kernel
        if attn_mask is not None:
            attn_mask = attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return ops._scaled_dot_product_efficient_attention(q, k, v, attn_mask, True, dropout_p, is_causal,
                                                           scale=scale)[0]

    def dropout(x, p=0.5, training=True, inplace=False):
        return torch.native_dropout(x, p, training)[0] if training and p > 0 else x
    kept = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in kept:
            seen[st._cdata] = st.nbytes()
        return t
    originals = f.scaled_dot_product_attention, f.dropout, masking.find_packed_sequence_indices
    f.scaled_dot_product_attention, f.dropout = sdpa, dropout
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            call(model)
    finally:
        f.scaled_dot_product_attention, f.dropout, masking.find_packed_sequence_indices = originals
    return sum(seen.values())
