"""Which test functions the quick tier leaves out, and the quick test that touches the same
feature instead (conftest.py marks the first ``slow`` and checks, on a whole run, that
both are collected and that the second runs in the quick tier).

The quick tier (``pytest -m "not slow"``, 3 minutes on 2 cores) runs each test function
once; a function whose one case costs seconds (a subprocess, a kernel build, a whole
model, a long decode) is left out of it when a quicker test touches its feature. The
default run and CI run all of them. Measured on a 2-core Zen 3 (AVX2): the functions
below took 2.5-36 s each in the quick tier, 640 s of its 985 s of test time.
"""

from __future__ import annotations

B = "tests/benchmarks/"
D = "tests/distributed/"
E = "tests/examples/"
F = "tests/functional/"
H = "tests/harness/"
I = "tests/interop/"  # noqa: E741
K = "tests/kernels/"
M = "tests/modules/"

QUICK_STAND_INS: dict[str, str] = {
    # benchmarks: the tiny runs of the sweep and of the decode loop
    B + "test_benchmarks.py::test_tiny_run_writes_json_table_and_plot":
        B + "test_benchmarks.py::test_a_spent_budget_records_every_case_as_not_run",
    B + "test_benchmarks.py::test_time_floors_add_warmup_and_runs":
        B + "test_benchmarks.py::test_a_spent_budget_records_every_case_as_not_run",
    B + "test_decode.py::test_every_system_decodes_the_same_and_the_results_record_the_machine":
        B + "test_decode.py::test_one_of_ours_that_decodes_wrong_fails_the_run",
    B + "test_decode.py::test_a_system_past_the_budget_runs_once":
        B + "test_decode.py::test_one_of_ours_that_decodes_wrong_fails_the_run",
    B + "test_decode.py::test_a_wrong_sdpa_loop_is_recorded_and_in_no_ratio":
        B + "test_decode.py::test_one_of_ours_that_decodes_wrong_fails_the_run",
    # the delta-rule benchmark: the wrong-outside-system run checks the verdicts and the ratios
    B + "test_delta_benchmark.py::test_a_tiny_run_times_every_system_and_writes_the_record":
        B + "test_delta_benchmark.py::test_a_wrong_outside_system_is_recorded_and_in_no_ratio",
    # the flex benchmark: its tiny run checks every system's verdict against the oracle
    B + "test_flex_benchmark.py::test_a_wrong_twin_fails_the_flex_benchmark":
        B + "test_flex_benchmark.py::test_every_system_runs_agrees_and_the_record_holds_the_ratios",
    B + "test_flex_benchmark.py::test_a_wrong_torch_compile_flex_is_recorded_and_left_out_of_the_ratios":
        B + "test_flex_benchmark.py::test_every_system_runs_agrees_and_the_record_holds_the_ratios",
    # scale-out: one JAX ring and one PyTorch ring stay
    D + "test_distributed.py::test_sharded_training_step_equals_unsharded":
        D + "test_distributed.py::test_jax_ring_on_one_device_in_process",
    # chunked attention: the JAX ring's compile (seconds); the PyTorch ring over chunks stays
    F + "test_chunked.py::test_jax_ring_over_chunks_equals_one_device":
        F + "test_chunked.py::test_torch_ring_over_chunks_equals_one_process",
    # whole-model ports
    E + "test_ports.py::test_a_faithful_port_shows_no_divergence":
        E + "test_ports.py::test_a_nudged_weight_is_located_at_its_module",
    E + "test_ports.py::test_a_port_without_padding_idx_fails_at_that_embedding_row":
        E + "test_ports.py::test_a_nudged_weight_is_located_at_its_module",
    E + "test_ports.py::test_ten_adamw_steps_agree_and_train":
        H + "test_training_parity.py::test_ten_steps_agree",
    E + "test_ports.py::test_the_examples_use_our_attention_at_512_positions":
        E + "test_ports.py::test_a_nudged_weight_is_located_at_its_module",
    E + "test_ports.py::test_logits_and_every_gradient_agree":
        E + "test_ports.py::test_a_nudged_weight_is_located_at_its_module",
    H + "test_divergence.py::test_a_faithful_port_is_clean_forward_and_backward":
        H + "test_divergence.py::test_one_weight_nudged_by_1e3_is_located_at_its_projection",
    H + "test_divergence.py::test_a_wrong_layernorm_epsilon_is_located_at_that_norm":
        H + "test_divergence.py::test_one_weight_nudged_by_1e3_is_located_at_its_projection",
    H + "test_divergence.py::test_qk_norms_are_seen_as_submodules_and_located":
        H + "test_divergence.py::test_a_swapped_rotary_layout_is_located_at_that_rotation",
    # whole transformers models: Llama's k_proj found at our W_key pairs Hugging Face's children
    H + "test_whole_ports.py::test_a_whole_port_is_ok_forward_and_backward_without_a_module_map":
        E + "test_ports.py::test_a_nudged_weight_is_located_at_its_module",
    H + "test_whole_ports.py::test_a_norm_epsilon_planted_in_layer_1_is_named_there":
        E + "test_ports.py::test_a_nudged_weight_is_located_at_its_module",
    I + "test_from_hf.py::test_locate_divergence_finds_each_family_clean_with_no_module_map":
        E + "test_ports.py::test_a_nudged_weight_is_located_at_its_module",
    H + "test_whole_ports.py::test_one_call_proves_the_port_and_names_a_planted_bug":
        E + "test_ports.py::test_a_nudged_weight_is_located_at_its_module",
    H + "test_whole_ports.py::test_a_whole_gemma3_port_with_sliding_and_global_layers_and_a_tied_head":
        E + "test_ports.py::test_a_nudged_weight_is_located_at_its_module",
    H + "test_whole_ports.py::test_left_padding_without_rows_points_to_rows":
        H + "test_harness_rows.py::test_padded_rows_fail_without_rows_outputs_and_gradients",
    H + "test_whole_ports.py::test_gpt2s_packed_conv1d_and_tied_weights_are_derived":
        H + "test_whole_ports.py::test_a_tie_is_kept_only_where_the_port_ties_too",
    # issue 56: the family proofs (each one call at 512 positions; the MoE's planted bug, its
    # eager run 6 s) stand in for by SmolLM3's planted bug; Gemma 2's boundary mismatch by the
    # small model's split scale
    H + "test_family_proofs.py::test_a_whole_qwen3_moe_port_is_proven_in_one_call":
        H + "test_family_proofs.py::test_a_smollm3_nope_layer_that_rotates_is_named_at_that_layer",
    H + "test_family_proofs.py::test_a_qwen3_moe_router_that_forgets_to_renormalise_is_named_at_its_gate":
        H + "test_family_proofs.py::test_a_smollm3_nope_layer_that_rotates_is_named_at_that_layer",
    H + "test_family_proofs.py::test_a_whole_smollm3_port_with_a_nope_layer_is_proven_in_one_call":
        H + "test_family_proofs.py::test_a_smollm3_nope_layer_that_rotates_is_named_at_that_layer",
    # Llama 4 and Gemma 4 (each whole model built and ported in 5-7 s): their MoE block
    # beside transformers' (3 s) stands in
    **{H + "test_family_proofs_2026.py::" + name:
       H + "test_family_proofs_2026.py::test_the_llama4_moe_written_here_agrees_with_transformers_at_40_tokens"
       for name in ("test_a_whole_llama4_port_with_chunks_and_a_nope_layer_is_proven_in_one_call",
                    "test_a_llama4_nudged_query_in_the_chunked_layer_is_named_at_that_projection",
                    "test_llama4_chunks_under_left_padding_are_counted_from_each_rows_first_token",
                    "test_a_whole_gemma4_port_with_sliding_and_full_layers_of_two_widths_is_proven_in_one_call",
                    "test_a_gemma4_nudged_query_in_the_full_layer_is_named_at_that_projection")},
    # issue 57: the hybrid proofs (Qwen3.5, Kimi Linear: each whole model ported, proven at 512
    # positions, a planted bug named; the delta rule's compile and eager run) stand in for by
    # the Qwen3.5 linear-attention layer written there, a left-padded prompt and steps (3 s)
    **{H + "test_hybrid_proofs.py::" + name:
       H + "test_hybrid_proofs.py::test_the_qwen3_5_linear_layer_written_here_agrees_with_transformers_on_a_left_"
           "padded_prompt_and_steps"
       for name in ("test_a_whole_qwen3_5_port_with_a_gated_delta_layer_is_proven_in_one_call",
                    "test_a_qwen3_5_nudged_gate_in_the_linear_layer_is_named_at_that_projection",
                    "test_a_whole_kimi_linear_port_with_a_kda_layer_beside_latent_attention_is_proven_in_one_call",
                    "test_a_kimi_nudged_query_in_the_kda_layer_is_named_at_that_projection")},
    # issue 58: the DeepSeek-V3.2 proofs (the JAX twin's whole model at 512 positions, 41 s;
    # locate_divergence's planted indexer bug and tied scores, 7 s and 5 s): the PyTorch twin in
    # transformers' model (its choices, logits and gradients, 3.5 s) stands in
    **{H + "test_sparse_proofs.py::" + name:
       H + "test_sparse_proofs.py::test_a_deepseek_v32_with_our_pytorch_attention_gives_its_choices_logits_and_gradients"
       for name in ("test_a_whole_deepseek_v32_port_is_proven_in_one_call",
                    "test_a_planted_indexer_bug_is_named_at_that_layers_choice_of_keys",
                    "test_scores_tied_at_the_relus_zero_are_reported_as_ties_not_a_divergence")},
    H + "test_divergence.py::test_a_scale_moved_out_of_the_embedding_is_a_boundary_mismatch_not_a_divergence":
        H + "test_divergence.py::test_a_scale_split_across_modules_is_searched_past_in_a_small_model",
    H + "test_divergence.py::test_a_bug_behind_a_boundary_mismatch_is_still_named":
        H + "test_divergence.py::test_a_scale_split_across_modules_is_searched_past_in_a_small_model",
    # functional options
    F + "test_bias_softcap.py::test_twins_agree":
        F + "test_bias_softcap.py::test_modules_take_bias_and_softcap",
    F + "test_bias_softcap.py::test_module_bias_fused_without_softcap":
        F + "test_bias_softcap.py::test_modules_take_bias_and_softcap",
    F + "test_chex.py::test_one_sgd_step_in_each_framework_gives_the_same_tree":
        H + "test_training_parity.py::test_ten_steps_agree",
    F + "test_chex.py::test_module_under_nnx_jit_traces_once_per_mode":
        F + "test_chex.py::test_functional_core_traces_once_per_shape_and_options",
    F + "test_dropout_paths.py::test_flax_module_dropout_in_training_mode":
        F + "test_jit.py::test_flax_dropout_train_draws_and_advances",
    F + "test_implementations.py::test_tpu_splash_kernel_matches_reference":
        F + "test_implementations.py::test_auto_on_cpu_by_query_rows",
    F + "test_long_sequences.py::test_real_tiles_against_the_reference_path":
        F + "test_long_sequences.py::test_training_memory_at_32768_keys_is_not_quadratic",
    F + "test_masks_dropout.py::test_fully_masked_rows_have_finite_zero_gradients_jax":
        F + "test_masks_dropout.py::test_fully_masked_module_rows_agree_between_frameworks",
    F + "test_numeric_edges.py::test_decode_one_token_at_a_time_into_a_4096_cache":
        M + "test_compiled_decoding.py::test_a_jitted_step_has_no_host_callback_and_attends_by_buckets",
    F + "test_route_jax.py::test_asking_for_another_target_builds_nothing":
        F + "test_route_jax.py::test_asking_builds_nothing",
    F + "test_route_jax.py::test_a_build_that_fails_at_the_call_falls_back":
        K + "test_build_kernel.py::test_a_failed_build_exits_non_zero_saying_why",
    F + "test_sinks_jax.py::test_every_path_against_the_oracle_float32":
        F + "test_sinks_jax.py::test_float64_against_the_oracle",
    F + "test_structure_options.py::test_blockwise_tiles_give_keys_outside_every_window_no_gradient":
        F + "test_structure_options.py::test_keys_outside_every_window_get_no_gradient",
    # the harness
    H + "test_training_stack.py::test_decode_equals_full_forward":
        M + "test_compiled_decoding.py::test_a_donated_cache_is_updated_in_place",
    H + "test_training_stack.py::test_cached_step_with_mask_bias_and_weights_matches_the_twin":
        M + "test_compiled_decoding.py::test_a_step_on_the_cpu_kernel_reads_the_cache_as_it_lies",
    H + "test_training_stack.py::test_refused_decode_leaves_the_cache_as_it_was":
        M + "test_cache_and_call_checks.py::test_a_donated_cache_comes_back_with_the_record_after_an_overflow",
    H + "test_training_stack.py::test_module_options":
        H + "test_training_stack.py::test_gqa_projections_are_sized_for_kv_heads_and_convert",
    # interop
    I + "test_conversion.py::test_jax_interop_works_without_torch":
        I + "test_conversion.py::test_jax_array_converters_round_trip_numpy_and_state",
    I + "test_from_hf_latent.py::test_the_twins_train_in_parity":
        I + "test_from_hf_latent.py::test_round_trips_are_bit_exact",
    I + "test_native_flax.py::test_from_nnx_matches_native":
        I + "test_native_flax.py::test_from_linen_matches_native",
    I + "test_native_flax.py::test_from_nnx_cross_attention":
        I + "test_native_flax.py::test_from_linen_matches_native",
    I + "test_native_flax.py::test_nnx_round_trips_are_exact":
        I + "test_native_flax.py::test_to_nnx_matches_ours_causal_and_unbiased",
    I + "test_native_flax.py::test_native_is_causal_is_our_causal_mask":
        I + "test_native_flax.py::test_to_nnx_matches_ours_causal_and_unbiased",
    # the CPU kernel: its builds
    K + "test_cpu_kernel.py::test_auto_and_an_avx2_build":
        K + "test_cpu_kernel.py::test_auto_takes_the_kernel_where_it_applies",
    K + "test_cpu_kernel.py::test_the_kernel_can_be_turned_off_or_required":
        K + "test_cpu_kernel.py::test_only_a_fused_or_auto_call_asks_for_the_kernel",
    K + "test_cpu_kernel.py::test_without_the_kernel_fused_is_xla_and_auto_blockwise":
        K + "test_cpu_kernel.py::test_only_a_fused_or_auto_call_asks_for_the_kernel",
    K + "test_cpu_kernel_cache.py::test_a_truncated_library_is_rebuilt_not_loaded":
        K + "test_cpu_kernel_cache.py::test_a_library_without_the_kernels_symbols_is_rebuilt",
    K + "test_build_kernel.py::test_the_command_builds_into_the_cache_and_a_later_load_does_not_rebuild":
        K + "test_build_kernel.py::test_a_failed_build_exits_non_zero_saying_why",
    # modules
    M + "test_compiled_decoding.py::test_decoding_equals_the_oracle_and_the_full_forward":
        M + "test_compiled_decoding.py::test_a_donated_cache_is_updated_in_place",
    M + "test_free_widths.py::test_twins_have_the_same_parameters_shapes_and_cache":
        M + "test_free_widths.py::test_parity_and_oracle_on_every_path",
    M + "test_free_widths.py::test_the_matrix_variants_on_every_path":
        M + "test_free_widths.py::test_parity_and_oracle_on_every_path",
    M + "test_free_widths.py::test_nnx_multihead_takes_free_widths":
        M + "test_free_widths.py::test_parity_and_oracle_on_every_path",
    M + "test_global_state.py::test_the_modules_are_float32_accurate_without_any_global_flag":
        M + "test_global_state.py::test_check_parity_sets_full_precision_inside_and_restores_the_flags",
    M + "test_projection_mechanisms.py::test_latent_attention_query_scale_and_mistral4":
        M + "test_projection_mechanisms.py::test_query_scale_by_hand",
    M + "test_latent_attention.py::test_decoding_equals_the_full_forward":
        M + "test_compiled_decoding.py::test_latent_attention_records_an_overflow_under_jit_too",
    M + "test_latent_attention.py::test_the_flax_decode_step_compiles_once":
        M + "test_compiled_decoding.py::test_latent_attention_records_an_overflow_under_jit_too",
    M + "test_latent_attention.py::test_both_twins_match_transformers_deepseek_v3_attention":
        I + "test_from_hf_latent.py::test_round_trips_are_bit_exact",
    M + "test_latent_attention.py::test_packed_sequences_attend_as_each_sequence_alone":
        M + "test_latent_attention.py::test_every_path_matches_the_oracle_and_the_twin",
    M + "test_latent_attention.py::test_padding_by_lengths_window_and_bias":
        M + "test_latent_attention.py::test_every_path_matches_the_oracle_and_the_twin",
    M + "test_latent_attention.py::test_dropout_in_training_mode":
        M + "test_latent_attention.py::test_every_path_matches_the_oracle_and_the_twin",
    M + "test_latent_attention.py::test_parameters_are_hugging_face_s":
        M + "test_latent_attention.py::test_round_trips_are_bit_exact",
    M + "test_latent_attention.py::test_softcap_is_refused_by_the_fused_path_by_name":
        M + "test_latent_attention.py::test_a_bad_call_has_one_error_text",
    M + "test_qk_norm.py::test_flax_under_jit_equals_eager":
        M + "test_qk_norm.py::test_parity_and_oracle_on_every_path",
    M + "test_qk_norm.py::test_the_matrix_variants_on_every_path":
        M + "test_qk_norm.py::test_parity_and_oracle_on_every_path",
    M + "test_registry.py::test_per_call_implementation_override":
        H + "test_harness.py::test_the_modules_run_on_the_path_asked_for",
    M + "test_registry.py::test_flax_dtype_is_computation_param_dtype_is_storage":
        H + "test_harness.py::test_pytorchs_dtype_is_flaxs_param_dtype",
    M + "test_rope_modules.py::test_oracle_and_twin_at_positions_beyond_400":
        M + "test_rope_modules.py::test_llama_attention_with_the_same_weights_at_positions_beyond_400",
    M + "test_rope_modules.py::test_a_padded_prompt_continues_from_each_example_s_fill":
        M + "test_rope_modules.py::test_unbatched_and_shared_positions",
    M + "test_rope_modules.py::test_apply_rope_with_transformers_inv_freq_is_bit_for_bit":
        F + "test_rope.py::test_inv_freq_default_matches_transformers_default",
    M + "test_sinks_modules.py::test_the_sinks_gradient_is_the_oracles_finite_difference":
        F + "test_sinks_jax.py::test_the_sink_gradient_against_finite_differences_of_the_oracle",
    # every causal-LM family of transformers (one 40-50 s sweep): the recogniser's own refusal stays quick
    I + "test_hf_families.py::test_every_family_ports_within_1e_5_or_is_refused_naming_its_mechanism":
        I + "test_from_hf.py::test_a_module_that_is_no_attention_layer_is_a_type_error_naming_what_it_holds",
    I + "test_hf_families.py::test_the_named_families_port_and_the_others_name_their_mechanism":
        I + "test_from_hf.py::test_a_module_that_is_no_attention_layer_is_a_type_error_naming_what_it_holds",
    I + "test_hf_families.py::test_docs_list_the_families_from_hf_ports":
        I + "test_from_hf.py::test_a_module_that_is_no_attention_layer_is_a_type_error_naming_what_it_holds",
    # DeepSeek-V4's attention: the Flax cached decode compiles a step per length; PyTorch's cached steps stay
    M + "test_compressed_attention.py::test_flax_cached_decode":
        M + "test_compressed_attention.py::test_against_transformers_whole_and_cached",
}
