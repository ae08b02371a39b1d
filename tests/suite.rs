//! trainkit's integration tests, one module per file beside this one, built as one test
//! binary: the public API and the `trainkit` binary, on the CPU and the CUDA emulator.
//!
//! One binary links the library once, not once per file (about fifty links of a 60 MB
//! binary, and the generic trainer compiled again in each). The files that stay test
//! binaries of their own are listed in Cargo.toml: the CUDA checks the GPU bundle carries
//! (`cuda_backend`, `nvrtc_kernels`, `custom_op`, `offset_norm`), `cpu_blas` (it sets
//! `$TRAINKIT_BLAS`, which every CPU backend of the process would read) and
//! `data_parallel` (built again with the `mpi` feature). Run one file's tests with
//! `cargo test --test suite FILE::`.

mod common;

mod accumulation;
mod autofit;
mod budget;
mod chat_templates;
mod cli;
mod cli_memory;
mod configs;
mod custom_policies;
mod data_formats;
mod data_shards;
mod documents;
mod dora;
mod efficiency;
mod families;
mod flash_attention;
mod fp16;
mod fused_loss;
mod fuzz_seeds;
mod hf_tokenizer;
mod init_from;
mod kv_cache;
mod lion;
mod llama;
mod lora;
mod memory_cli;
mod memory_estimate;
mod memory_events;
mod memory_peaks;
mod memory_timeline;
mod nccl;
mod nf4;
mod offload;
mod op_gradients;
mod optimizer_in_backward;
mod optimizer_offload;
mod precision;
mod pure_bf16;
mod qlora;
mod qwen;
mod recompute;
mod reference_model;
mod reliability;
mod save_resume;
mod streaming;
