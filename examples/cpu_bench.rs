//! CPU throughput of a full training step (forward, backward, AdamW) in f32: the median
//! and the best of 7 timed steps after 2 warm-up steps.
//!
//! It also prints the process's CPU time per step: on a shared machine whose other
//! tenants take cores away, wall time varies from run to run while CPU time stays steady,
//! so CPU time is the figure to compare two builds by.
//!
//! Matrix products run on the `gemm` crate, or on the CBLAS library `$TRAINKIT_BLAS`
//! names (Intel MKL, OpenBLAS, BLIS).
//!
//! `cargo run --release --example cpu_bench` measures the four shapes of
//! docs/benchmarks.md (a and b: GPT-2; c: a Llama with grouped-query attention; d: a
//! GPT-2 on sequences of 2048); `-- --shape a` (or b, c, d) runs one. `-- --ops` also prints
//! where the timed steps' time went, op by op (from the ledger's op spans).
//! `-- --loss materialized` runs the materialized loss instead of the fused one,
//! `-- --loss-chunk N` sets the fused loss's positions per chunk, and
//! `-- --attention materialized` the materialized attention instead of the fused one.

use std::sync::Arc;
use std::time::Instant;
use trainkit::data::DataLoader;
use trainkit::memory::OpProfile;
use trainkit::model::{Rope, RopeScaling};
use trainkit::{CpuBackend, Gpt2Config, LlamaConfig, ModelConfig, Rng, Trainer};

struct Shape {
    name: &'static str,
    config: ModelConfig,
    batch: usize,
    seq: usize,
}

fn shapes() -> Vec<Shape> {
    vec![
        Shape {
            name: "a",
            config: ModelConfig::new(Gpt2Config {
                n_layer: 4,
                n_head: 4,
                n_embd: 256,
                n_positions: 256,
                vocab_size: 50257,
                layer_norm_epsilon: 1e-5,
            }),
            batch: 8,
            seq: 256,
        },
        Shape {
            name: "b",
            config: ModelConfig::new(Gpt2Config {
                n_layer: 6,
                n_head: 6,
                n_embd: 384,
                n_positions: 256,
                vocab_size: 256,
                layer_norm_epsilon: 1e-5,
            }),
            batch: 16,
            seq: 256,
        },
        Shape {
            name: "c",
            config: ModelConfig::new(LlamaConfig {
                hidden_size: 384,
                intermediate_size: 1024,
                num_hidden_layers: 6,
                num_attention_heads: 6,
                num_key_value_heads: 2,
                head_dim: 64,
                vocab_size: 256,
                max_position_embeddings: 256,
                rms_norm_eps: 1e-5,
                tie_word_embeddings: false,
                initializer_range: 0.02,
                rope: Rope {
                    theta: 10_000.0,
                    scaling: RopeScaling::Default,
                },
            }),
            batch: 16,
            seq: 256,
        },
        Shape {
            name: "d",
            config: ModelConfig::new(Gpt2Config {
                n_layer: 4,
                n_head: 4,
                n_embd: 256,
                n_positions: 2048,
                vocab_size: 256,
                layer_norm_epsilon: 1e-5,
            }),
            batch: 2,
            seq: 2048,
        },
    ]
}

fn main() -> trainkit::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let only = args
        .iter()
        .position(|a| a == "--shape")
        .and_then(|i| args.get(i + 1).cloned());
    let ops = args.iter().any(|a| a == "--ops");
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let loss = match flag("--loss") {
        Some(name) => trainkit::ops::LossPath::parse("--loss", &name)?,
        None => trainkit::ops::LossPath::Fused,
    };
    let attention = match flag("--attention") {
        Some(name) => trainkit::ops::AttentionPath::parse("--attention", &name)?,
        None => trainkit::ops::AttentionPath::Fused,
    };
    let loss_chunk = match flag("--loss-chunk") {
        Some(n) => Some(
            n.parse::<usize>()
                .map_err(|_| trainkit::Error::config("--loss-chunk", "must be a number"))?,
        ),
        None => None,
    };
    let (warmup, timed) = (2, 7);
    let backend = Arc::new(CpuBackend::from_env()?);
    println!(
        "threads: {}; matrix products: {}",
        rayon::current_num_threads(),
        backend
            .blas()
            .map_or("the gemm crate".to_string(), |b| b.to_string())
    );
    for s in shapes() {
        if only.as_deref().is_some_and(|o| o != s.name) {
            continue;
        }
        let mut rng = Rng::new(0);
        let v = s.config.vocab_size();
        let tokens: Vec<u32> = (0..s.batch * s.seq * (warmup + timed + 1) + 1)
            .map(|_| rng.below(v) as u32)
            .collect();
        let data = DataLoader::new(tokens, s.batch, s.seq)?;
        let model = s.config.build_with(attention, loss, loss_chunk)?;
        let mut t = Trainer::builder(
            model,
            Arc::clone(&backend) as Arc<dyn trainkit::Backend>,
            data,
        )
        .observer(OpProfile::default())
        .build()?;
        for _ in 0..warmup {
            t.step()?;
        }
        let mut secs = Vec::with_capacity(timed);
        let mut cpu = Vec::with_capacity(timed);
        let mut faults = 0;
        let before_timed = t.observer().clone();
        for _ in 0..timed {
            let (start, before) = (Instant::now(), Usage::now());
            t.step()?;
            let after = Usage::now();
            secs.push(start.elapsed().as_secs_f64());
            cpu.push(after.cpu_secs - before.cpu_secs);
            faults += after.minor_faults - before.minor_faults;
        }
        secs.sort_by(f64::total_cmp);
        cpu.sort_by(f64::total_cmp);
        let tok = (s.batch * s.seq) as f64;
        println!(
            "shape {}: {}, batch {} x {}: median {:.0} tokens/s ({:.0} ms/step), best {:.0} \
             tokens/s",
            s.name,
            t.model().describe(),
            s.batch,
            s.seq,
            tok / secs[timed / 2],
            secs[timed / 2] * 1e3,
            tok / secs[0]
        );
        println!(
            "  process CPU time per step: median {:.0} ms ({:.2} cores busy), least {:.0} ms; \
             {} page faults per step",
            cpu[timed / 2] * 1e3,
            cpu[timed / 2] / secs[timed / 2],
            cpu[0] * 1e3,
            faults / timed as i64
        );
        if ops {
            print!(
                "{}",
                t.observer().since(&before_timed).table(secs.iter().sum())
            );
        }
    }
    Ok(())
}

/// The process's CPU time (user and system, all threads) and minor page faults so far.
struct Usage {
    cpu_secs: f64,
    minor_faults: i64,
}

impl Usage {
    fn now() -> Usage {
        // SAFETY: `getrusage` fills the zeroed struct it is given.
        let ru = unsafe {
            let mut ru: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_SELF, &mut ru);
            ru
        };
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
        Usage {
            cpu_secs: secs(ru.ru_utime) + secs(ru.ru_stime),
            minor_faults: ru.ru_minflt as i64,
        }
    }
}
