"""Which of PyTorch's DistributedTest tests the conformance tier runs, and why these.

``DistributedTest._DistTestBase`` (torch 2.13) has 285 tests. On this CPU-only setup gloo
passes 90 of them, the same 90 at world sizes 2 and 3; the rest skip (CUDA, NCCL, MPI,
"world size < 8" for the ``*_group`` variants, or file:// init only). Measured on the
project's 2-core machine with the fork driver, running all 285 takes 80-115 s per (backend,
world size) and the 90 alone about 45-65 s: four runs of them would be 4 minutes, over the
tier's budget. And ringcoll passed all 90 except the name-based exceptions (listed in
``test_torch_suite.py``) at both world sizes when this selection was made. (By hand, at
world 8: the 20 ``*_group`` tests gloo passes there pass on ringcoll too, 23-26 s a run.)

So the selection keeps every test whose calls reach ringcoll's own code (the ring
collectives and the routing in ``ringcoll/training/backend.py``) and, for the collectives
the backend forwards to its internal gloo group, one or two tests each (the forwarding is
one code path; the other variants test gloo). Dropped: the ``*_profiler`` variants of
send/recv (profiler bookkeeping over the same forwarded calls), the other ops of ``reduce``,
``gather`` and ``scatter`` (forwarded), ``monitored_barrier`` (refused by name for any
backend but gloo), ``test_dump_DDP_relevant_env_vars`` and ``get_rank`` (nothing of the
backend's). To run any other test by hand: ``dist_suite.py --tests NAME``.
"""

SELECTION = [
    # --- all_reduce: the ring (every op, async, complex as a real view) ------------------
    "test_all_reduce_sum",
    "test_all_reduce_product",
    "test_all_reduce_min",
    "test_all_reduce_max",
    "test_all_reduce_sum_async",
    "test_all_reduce_sum_complex",
    "test_all_reduce_complex_unsupported_ops",  # MAX/MIN/PRODUCT on complex must raise
    "test_all_reduce_full_group_sum",  # a dist.new_group() of every rank: a second ring
    "test_all_reduce_full_group_product",
    "test_all_reduce_full_group_min",
    "test_all_reduce_full_group_max",
    "test_sparse_all_reduce_sum",  # sparse tensors: must be routed to gloo
    "test_get_future",  # Work.get_future() of an async all_reduce
    # --- all_reduce_coalesced: one flat ring call ------------------------------------------
    "test_all_reduce_coalesced_sum",
    "test_all_reduce_coalesced_product",
    "test_all_reduce_coalesced_min",
    "test_all_reduce_coalesced_max",
    "test_all_reduce_coalesced_max_complex_unsupported",
    "test_all_reduce_coalesced_full_group_sum",
    "test_all_reduce_coalesced_full_group_max",
    # --- all_gather (list form), all_gather_coalesced, object collectives ------------------
    "test_all_gather",
    "test_all_gather_complex",
    "test_all_gather_full_group",
    "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_complex",
    "test_all_gather_coalesced_full_group",
    "test_all_gather_coalesced_with_empty",
    "test_all_gather_object_default_pg",  # pickled bytes through all_gather
    "test_all_gather_object_subgroup",
    # --- barrier ---------------------------------------------------------------------------
    "test_barrier",
    "test_barrier_full_group",
    "test_barrier_timeout_full_group",  # a group's 1 s timeout must bound the wait
    # --- DDP on CPU: the reducer's bucket all_reduces through the trampoline, comm hooks ----
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",  # a hook chaining .then()
    "test_grads_same_across_ranks_with_no_sync",
    "test_ddp_create_graph",
    "test_static_graph_api_cpu",
    "test_ddp_logging_data_cpu",  # DDP's logging reads the process group's backend name
    # --- forwarded to the internal gloo group: one or two of each family -------------------
    "test_broadcast",
    "test_broadcast_full_group",
    "test_reduce_sum",
    "test_gather",
    "test_scatter",
    "test_scatter_object_list",
    "test_send_recv",
    "test_send_recv_any_source",
    "test_isend",
    "test_irecv",
    "test_batch_isend_irecv_gloo",
    # --- the process group's life and identity ---------------------------------------------
    "test_destroy_group",
    "test_destroy_full_group",
    "test_Backend_enum_class",
    "test_get_backend",  # a name-based exception: kept to show it still is one
]
