"""Kernel infrastructure the core and every family share: nothing here knows a pool or a family.

- :mod:`kvcore.kernels.launch`: launching compiled Triton kernels directly (launch keys, call plans);
- :mod:`kvcore.kernels.addresses`: kernel holders that keep their tensors' addresses work them out again when
  copied (``copy.deepcopy`` of a pool, an allocator, a gather);
- :mod:`kvcore.kernels.kernel_mode`: ``auto`` / ``triton`` / ``native``, and the interpreter;
- :mod:`kvcore.kernels.dtypes` and :mod:`kvcore.kernels.fp8`: cache dtypes (fp8 stored as bytes), conversion
  codes, bit-exact fp8 and bf16 encodings;
- :mod:`kvcore.kernels.row_move`: the overlap-safe move of token rows across every layer of stacked buffers;
- :mod:`kvcore.kernels.free_list` and :mod:`kvcore.kernels.allocator_kernels`: the allocators' device-side free
  lists and index arithmetic;
- :mod:`kvcore.kernels.head_gather` (its kernels in :mod:`kvcore.kernels.head_gather_kernels`): a batch's keys and
  values gathered into ``[batch, heads, seq, dim]`` in one launch (what dense attention implementations read);
  :mod:`kvcore.kernels.resident_gather`: the same with every layer's gathered rows kept between calls, a call
  writing only the tokens they lack;
- :mod:`kvcore.kernels.tensor_guard`: whether tensors are laid out as a planned launch's were, in one call.

May import: :mod:`kvcore.errors` and :mod:`kvcore.token_rows` (the description of where a token's rows are),
besides torch and Triton.  Importing this package loads no kernel; its modules do.
"""
