//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::sync::Arc;
use trainkit::data::{ByteTokenizer, DataLoader, SyntheticCorpus, Tokenizer};
use trainkit::{Backend, CpuBackend, DType, MemoryCategory, Rng, Tensor};

/// A fresh CPU backend.
pub fn cpu() -> Arc<dyn Backend> {
    Arc::new(CpuBackend::new())
}

/// `n` standard-normal values times `scale`.
pub fn randn(rng: &mut Rng, n: usize, scale: f64) -> Vec<f32> {
    (0..n).map(|_| (rng.normal() * scale) as f32).collect()
}

/// An f32 activation tensor.
pub fn tensor(be: &dyn Backend, data: &[f32], shape: &[usize]) -> Tensor {
    be.upload(data, shape, DType::F32, MemoryCategory::Activations, "test")
        .unwrap()
}

/// A loader over the built-in corpus.
pub fn corpus_loader(bytes: usize, seed: u64, batch: usize, seq: usize) -> DataLoader {
    let text = SyntheticCorpus::builtin().generate(bytes, seed);
    DataLoader::new(ByteTokenizer.encode(&text), batch, seq).unwrap()
}

/// A small GPT-2 for tests: 3 layers, 2 heads, 32 wide, bytes.
pub fn tiny_config() -> trainkit::Gpt2Config {
    trainkit::Gpt2Config {
        n_layer: 3,
        n_head: 2,
        n_embd: 32,
        n_positions: 32,
        vocab_size: 256,
        layer_norm_epsilon: 1e-5,
    }
}

/// One f32 vector per parameter, in model order, of the tensor `pick` chooses.
pub fn per_param<P, C, O, A, M>(
    t: &trainkit::Trainer<P, C, O, A, M>,
    pick: impl Fn(&trainkit::Param) -> &Tensor,
) -> Vec<Vec<f32>>
where
    P: trainkit::Precision,
    C: trainkit::CheckpointPolicy,
    O: trainkit::Optimizer,
    A: trainkit::AccumulationSchedule,
    M: trainkit::MemoryObserver,
{
    t.params()
        .iter()
        .map(|p| t.backend().to_f32(pick(p)).unwrap())
        .collect()
}

/// Every parameter's gradient (f32), in model order.
pub fn grads<P, C, O, A, M>(t: &trainkit::Trainer<P, C, O, A, M>) -> Vec<Vec<f32>>
where
    P: trainkit::Precision,
    C: trainkit::CheckpointPolicy,
    O: trainkit::Optimizer,
    A: trainkit::AccumulationSchedule,
    M: trainkit::MemoryObserver,
{
    per_param(t, |p| p.grad().expect("gradient"))
}

/// Every parameter's f32 values, in model order.
pub fn values<P, C, O, A, M>(t: &trainkit::Trainer<P, C, O, A, M>) -> Vec<Vec<f32>>
where
    P: trainkit::Precision,
    C: trainkit::CheckpointPolicy,
    O: trainkit::Optimizer,
    A: trainkit::AccumulationSchedule,
    M: trainkit::MemoryObserver,
{
    per_param(t, |p| p.value())
}
