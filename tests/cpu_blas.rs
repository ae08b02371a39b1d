//! The CPU backend's products on a CBLAS library loaded at run time.
//!
//! No BLAS is assumed on the machine: the tests build a small reference CBLAS (a plain
//! triple loop with f64 sums, exporting `cblas_sgemm` and OpenBLAS's thread control) with
//! the C++ compiler the CUDA emulator uses (`$CXX`, else `c++`), load it, and check every
//! way trainkit calls it against the built-in products.

mod common;

use common::{corpus_loader, randn, tensor, tiny_config};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};
use trainkit::ops::attention;
use trainkit::ops::Heads;
use trainkit::{Backend, Blas, CpuBackend, Error, Gpt2, Rng, Trainer};

/// A CBLAS `sgemm` for both layouts and all transposes, counting its calls, plus OpenBLAS's
/// `openblas_set_num_threads` and `openblas_get_config`.
const REFERENCE_CBLAS: &str = r#"
#include <atomic>
static std::atomic<long> calls{0};
static int threads = -1;
extern "C" {
long reference_calls() { return calls.load(); }
int reference_threads() { return threads; }
void openblas_set_num_threads(int n) { threads = n; }
const char* openblas_get_config() { return "reference"; }
void cblas_sgemm(int layout, int ta, int tb, int m, int n, int k, float alpha,
                 const float* a, int lda, const float* b, int ldb, float beta,
                 float* c, int ldc) {
    calls.fetch_add(1);
    bool row = layout == 101;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double s = 0.0;
            for (int p = 0; p < k; p++) {
                // op(A)(i, p) and op(B)(p, j) in either layout.
                bool at = ta != 111, bt = tb != 111;
                long ai = row ? (at ? (long)p * lda + i : (long)i * lda + p)
                              : (at ? (long)i * lda + p : (long)p * lda + i);
                long bi = row ? (bt ? (long)j * ldb + p : (long)p * ldb + j)
                              : (bt ? (long)p * ldb + j : (long)j * ldb + p);
                s += (double)a[ai] * (double)b[bi];
            }
            float* out = row ? &c[(long)i * ldc + j] : &c[(long)j * ldc + i];
            float prev = beta == 0.0f ? 0.0f : beta * *out;
            *out = (float)(alpha * s) + prev;
        }
}
}
"#;

/// A shared library with no `cblas_sgemm`.
const NOT_A_BLAS: &str = r#"extern "C" int something_else() { return 1; }"#;

/// Compiles `source` into a shared library in a fresh directory and returns its path.
fn build(name: &str, source: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("trainkit-blas-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join(format!("{name}.cpp"));
    std::fs::write(&src, source).unwrap();
    let lib = dir.join(format!("lib{name}.so"));
    let cxx = std::env::var("CXX")
        .ok()
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "c++".to_string());
    let mut words = cxx.split_whitespace();
    let status = Command::new(words.next().unwrap())
        .args(words)
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&lib)
        .arg(&src)
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C++ compiler `{cxx}` ({e}): set $CXX"));
    assert!(
        status.success(),
        "`{cxx}` failed to build {}",
        src.display()
    );
    lib
}

/// The reference library, built once per test binary, and a backend running on it.
fn reference() -> &'static (PathBuf, Arc<Blas>) {
    static LIB: OnceLock<(PathBuf, Arc<Blas>)> = OnceLock::new();
    LIB.get_or_init(|| {
        let path = build("reference_cblas", REFERENCE_CBLAS);
        let blas = Arc::new(Blas::load(&path).expect("load the reference CBLAS"));
        (path, blas)
    })
}

/// Calls of the reference `cblas_sgemm` so far, and the thread count it was given.
fn reference_counters(path: &Path) -> (i64, i32) {
    // SAFETY: the reference library exports both functions with these signatures.
    unsafe {
        let lib = libloading::Library::new(path).unwrap();
        let calls = lib
            .get::<unsafe extern "C" fn() -> i64>(b"reference_calls\0")
            .unwrap();
        let threads = lib
            .get::<unsafe extern "C" fn() -> i32>(b"reference_threads\0")
            .unwrap();
        (calls(), threads())
    }
}

fn close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 2e-5 * scale,
            "{what}: element {i} is {g}, the built-in product gives {w}"
        );
    }
}

#[test]
fn the_library_is_told_to_run_on_one_thread_and_named() {
    let (path, blas) = reference();
    assert_eq!(reference_counters(path).1, 1, "openblas_set_num_threads(1)");
    assert_eq!(blas.name(), "OpenBLAS (reference)");
    assert_eq!(blas.path(), path.as_path());
    assert!(blas.to_string().contains("OpenBLAS (reference)"));
}

#[test]
fn products_on_the_library_match_the_builtin_ones() {
    let (path, blas) = reference();
    let lib = CpuBackend::with_blas(Arc::clone(blas));
    let own = CpuBackend::new();
    let mut rng = Rng::new(7);
    let before = reference_counters(path).0;
    // Small products run as one call; the larger ones are cut into tiles on two threads
    // (rows, columns, or both), each tile one call with offset pointers.
    for &(m, n, k) in &[
        (3, 5, 4),
        (70, 90, 33),
        (600, 96, 40),
        (96, 600, 40),
        (384, 384, 16),
    ] {
        for (trans_a, trans_b) in [(false, false), (true, false), (false, true), (true, true)] {
            let a_shape = if trans_a { [k, m] } else { [m, k] };
            let b_shape = if trans_b { [n, k] } else { [k, n] };
            let a = randn(&mut rng, m * k, 1.0);
            let b = randn(&mut rng, k * n, 1.0);
            let bias = randn(&mut rng, n, 1.0);
            let start = randn(&mut rng, m * n, 1.0);
            for (with_bias, accumulate) in [(false, false), (true, false), (true, true)] {
                let mut out = Vec::new();
                for be in [&lib, &own] {
                    let at = tensor(be, &a, &a_shape);
                    let bt = tensor(be, &b, &b_shape);
                    let biast = tensor(be, &bias, &[n]);
                    let mut o = tensor(be, &start, &[m, n]);
                    be.matmul(
                        &mut o,
                        &at,
                        &bt,
                        with_bias.then_some(&biast),
                        trans_a,
                        trans_b,
                        accumulate,
                    )
                    .unwrap();
                    out.push(be.to_f32(&o).unwrap());
                }
                close(
                    &out[0],
                    &out[1],
                    &format!(
                        "[{m}, {n}] over {k}, transposes {trans_a}/{trans_b}, bias {with_bias}, \
                         accumulate {accumulate}"
                    ),
                );
            }
        }
    }
    assert!(
        reference_counters(path).0 > before + 60,
        "the products ran on the library"
    );
}

#[test]
fn attention_on_the_library_matches_the_builtin_one() {
    let (path, blas) = reference();
    let lib = CpuBackend::with_blas(Arc::clone(blas));
    let own = CpuBackend::new();
    let (b, t, c, h) = (2, 70, 24, 3);
    let mut rng = Rng::new(3);
    let qkv = randn(&mut rng, b * t * 3 * c, 1.0);
    let dout = randn(&mut rng, b * t * c, 1.0);
    let before = reference_counters(path).0;
    let mut results: Vec<Vec<Vec<f32>>> = vec![];
    for be in [&lib, &own] {
        let qkv = tensor(be, &qkv, &[b, t, 3 * c]);
        let dout = tensor(be, &dout, &[b, t, c]);
        let mut scores = tensor(be, &vec![0.0; b * h * t * t], &[b, h, t, t]);
        attention::scores(be, &mut scores, &qkv, Heads::mha(h, c)).unwrap();
        let mut probs = tensor(be, &vec![0.0; b * h * t * t], &[b, h, t, t]);
        attention::softmax(be, &mut probs, &scores).unwrap();
        let mut out = tensor(be, &vec![0.0; b * t * c], &[b, t, c]);
        attention::values(be, &mut out, &probs, &qkv, Heads::mha(h, c)).unwrap();
        let mut dprobs = tensor(be, &vec![0.0; b * h * t * t], &[b, h, t, t]);
        let mut dqkv = tensor(be, &vec![0.0; b * t * 3 * c], &[b, t, 3 * c]);
        attention::values_backward(
            be,
            &mut dprobs,
            &mut dqkv,
            &dout,
            &probs,
            &qkv,
            Heads::mha(h, c),
        )
        .unwrap();
        let mut dscores = tensor(be, &vec![0.0; b * h * t * t], &[b, h, t, t]);
        attention::softmax_backward(be, &mut dscores, &dprobs, &probs).unwrap();
        attention::scores_backward(be, &mut dqkv, &dscores, &qkv, Heads::mha(h, c)).unwrap();
        results.push(
            [&scores, &out, &dprobs, &dqkv]
                .iter()
                .map(|x| be.to_f32(x).unwrap())
                .collect(),
        );
    }
    for (i, what) in ["scores", "output", "dprobs", "dqkv"].iter().enumerate() {
        close(&results[0][i], &results[1][i], what);
    }
    assert!(
        reference_counters(path).0 > before,
        "attention's products ran on the library"
    );
}

#[test]
fn training_on_the_library_follows_the_builtin_products() {
    let (_, blas) = reference();
    let mut losses = vec![];
    for be in [CpuBackend::with_blas(Arc::clone(blas)), CpuBackend::new()] {
        let model = Gpt2::new(tiny_config()).unwrap();
        let mut t = Trainer::builder(model, Arc::new(be), corpus_loader(20_000, 1, 2, 16))
            .build()
            .unwrap();
        losses.push((0..3).map(|_| t.step().unwrap().loss).collect::<Vec<_>>());
    }
    for (a, b) in losses[0].iter().zip(&losses[1]) {
        assert!((a - b).abs() < 1e-4 * b.abs(), "losses {losses:?}");
    }
}

#[test]
fn an_unusable_library_is_a_clear_error() {
    let missing = Blas::load("/nonexistent/libmkl_rt.so").unwrap_err();
    let text = missing.to_string();
    assert!(matches!(missing, Error::Config { .. }), "{text}");
    assert!(
        text.contains("TRAINKIT_BLAS") && text.contains("no such file") && text.contains("MKL"),
        "{text}"
    );

    let not_blas = build("not_a_blas", NOT_A_BLAS);
    let text = Blas::load(&not_blas).unwrap_err().to_string();
    assert!(
        text.contains("does not export `cblas_sgemm`") && text.contains("TRAINKIT_BLAS"),
        "{text}"
    );

    let not_a_library = not_blas.with_file_name("not_a_blas.cpp");
    let text = Blas::load(&not_a_library).unwrap_err().to_string();
    assert!(text.contains("cannot be loaded"), "{text}");
}

#[test]
fn the_environment_variable_picks_the_library() {
    // The one test of this binary that touches the variable.
    let (path, _) = reference();
    std::env::set_var("TRAINKIT_BLAS", path);
    let on = CpuBackend::from_env().unwrap();
    std::env::set_var("TRAINKIT_BLAS", "/nonexistent/libblas.so");
    let bad = CpuBackend::from_env();
    std::env::set_var("TRAINKIT_BLAS", "");
    let off = CpuBackend::from_env().unwrap();
    std::env::remove_var("TRAINKIT_BLAS");
    assert_eq!(on.blas().map(|b| b.path()), Some(path.as_path()));
    assert!(bad
        .unwrap_err()
        .to_string()
        .contains("/nonexistent/libblas.so"));
    assert!(
        off.blas().is_none(),
        "an empty variable means the built-in products"
    );
}
