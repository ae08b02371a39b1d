//! Choosing cuBLASLt's algorithm for each product by timing it on the device.
//!
//! cuBLASLt's heuristic ranks the algorithms that can run a product by a model of the
//! device; its first choice is not always the fastest (on an H100, GPT-2's 768-wide
//! products ran at 357–476 TFLOP/s with it, others of the same step at 550–727). The
//! first time a product of a new shape runs, the CUDA backend asks the heuristic for its
//! top [`CANDIDATES`], runs each once to warm it up and [`TIMED_RUNS`] times between two
//! events, and keeps the fastest, unless it beats the heuristic's first choice by less
//! than [`MARGIN`] (timing noise should not change the algorithm from one run to the
//! next); at most [`MOST_TIMED`] products are timed per process. A product that
//! accumulates (`beta` 1) is timed on a scratch copy of its output, so that the output is
//! added to once, by the real run; every other output is written, not added to, and the
//! real run after the timing overwrites it.
//!
//! The choices are saved beside the kernel cache ([`super::KernelCache`]), one file per
//! device model, cuBLASLt version and workspace size ([`SavedChoices`]), so that the next
//! process on the machine (a resumed run above all: its products must run the algorithms
//! the run before used, for the resume to be bitwise) takes the same algorithm without
//! timing again. A saved algorithm is checked by cuBLASLt (`cublasLtMatmulAlgoCheck`)
//! before use and timed again when refused. `CudaOptions::tune_products` off takes the
//! heuristic's first choice untimed, as before, the same on every device that runs the
//! same cuBLASLt.

use super::gpu::{Gemm, MatrixLayout, MatrixType};
use crate::error::Result;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// The heuristic's candidates timed per product.
pub(crate) const CANDIDATES: usize = 8;

/// Runs of each candidate between the events, after one to warm it up.
pub(crate) const TIMED_RUNS: usize = 5;

/// How much faster than the heuristic's first choice a candidate must be to replace it.
pub(crate) const MARGIN: f64 = 0.03;

/// Products timed per process at most: a training run has a few dozen shapes, each timed
/// once; a loop whose shapes keep changing (decoding without the key/value cache, whose
/// context grows by a token a step) takes the heuristic's first choice past it instead of
/// timing every shape.
pub(crate) const MOST_TIMED: usize = 64;

/// What identifies a product for the choice of its algorithm: everything the descriptors
/// and the heuristic's preference hold, and whether it accumulates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct GemmKey {
    pub trans_a: bool,
    pub trans_b: bool,
    pub a: MatrixLayout,
    pub b: MatrixLayout,
    pub d: MatrixLayout,
    pub bias: bool,
    pub gelu: bool,
    /// The epilogue multiplies by GELU's derivative (`DGELU`).
    pub dgelu: bool,
    /// 0: no bias gradient; 1: of A; 2: of B.
    pub bias_grad: u8,
    pub tf32: bool,
    /// `beta` is not 0: C is read.
    pub accumulate: bool,
    /// The alignments of A, B, C and D the algorithm may assume.
    pub align: [u32; 4],
}

impl GemmKey {
    /// The key of `g`.
    pub(crate) fn of(g: &Gemm) -> GemmKey {
        GemmKey {
            trans_a: g.trans_a,
            trans_b: g.trans_b,
            a: g.a_layout,
            b: g.b_layout,
            d: g.d_layout,
            bias: g.bias != 0,
            gelu: g.gelu_aux != 0,
            dgelu: g.dgelu_aux != 0,
            bias_grad: match (g.bias_grad != 0, g.bias_grad_of_b) {
                (false, _) => 0,
                (true, false) => 1,
                (true, true) => 2,
            },
            tf32: g.allow_tf32,
            accumulate: g.beta != 0.0,
            align: [
                alignment(g.a),
                alignment(g.b),
                alignment(g.c_ptr()),
                alignment(g.d),
            ],
        }
    }

    /// The key as one line of text (no tab, no newline): `T N bf16:768x8192:768 ...`.
    pub(crate) fn line(self) -> String {
        let t = |b: bool| if b { "T" } else { "N" };
        let l = |m: &MatrixLayout| format!("{}:{}x{}:{}", type_name(m.ty), m.rows, m.cols, m.ld);
        format!(
            "{} {} {} {} {} bias={} gelu={} dgelu={} bias_grad={} tf32={} accumulate={} \
             align={},{},{},{}",
            t(self.trans_a),
            t(self.trans_b),
            l(&self.a),
            l(&self.b),
            l(&self.d),
            self.bias as u8,
            self.gelu as u8,
            self.dgelu as u8,
            self.bias_grad,
            self.tf32 as u8,
            self.accumulate as u8,
            self.align[0],
            self.align[1],
            self.align[2],
            self.align[3],
        )
    }

    /// The key [`GemmKey::line`] wrote, or `None` for any other text.
    pub(crate) fn parse(line: &str) -> Option<GemmKey> {
        let f: Vec<&str> = line.split(' ').collect();
        let [ta, tb, a, b, d, bias, gelu, dgelu, bias_grad, tf32, accumulate, align] = f[..] else {
            return None;
        };
        let t = |s: &str| match s {
            "T" => Some(true),
            "N" => Some(false),
            _ => None,
        };
        let layout = |s: &str| {
            let (ty, rest) = s.split_once(':')?;
            let (shape, ld) = rest.split_once(':')?;
            let (rows, cols) = shape.split_once('x')?;
            Some(MatrixLayout {
                ty: type_of(ty)?,
                rows: rows.parse().ok()?,
                cols: cols.parse().ok()?,
                ld: ld.parse().ok()?,
            })
        };
        fn value<'a>(s: &'a str, name: &str) -> Option<&'a str> {
            s.strip_prefix(name)?.strip_prefix('=')
        }
        let flag = |s: &str, name: &str| match value(s, name)? {
            "0" => Some(false),
            "1" => Some(true),
            _ => None,
        };
        let mut aligns = value(align, "align")?.split(',').map(|x| x.parse().ok());
        let mut next = || aligns.next().flatten();
        let align = [next()?, next()?, next()?, next()?];
        if aligns.next().is_some() {
            return None;
        }
        let bias_grad: u8 = value(bias_grad, "bias_grad")?.parse().ok()?;
        (bias_grad <= 2).then_some(())?;
        Some(GemmKey {
            trans_a: t(ta)?,
            trans_b: t(tb)?,
            a: layout(a)?,
            b: layout(b)?,
            d: layout(d)?,
            bias: flag(bias, "bias")?,
            gelu: flag(gelu, "gelu")?,
            dgelu: flag(dgelu, "dgelu")?,
            bias_grad,
            tf32: flag(tf32, "tf32")?,
            accumulate: flag(accumulate, "accumulate")?,
            align,
        })
    }
}

/// A product's name in reports: per-kernel timing's name for it and its element types,
/// `cublasLt 768x8192x3072 +gelu, bf16 → bf16`.
pub(crate) fn choice_name(g: &Gemm) -> String {
    format!(
        "{}, {} → {}",
        super::timing::gemm_name(g),
        type_name(g.a_layout.ty),
        type_name(g.d_layout.ty)
    )
}

fn type_name(t: MatrixType) -> &'static str {
    match t {
        MatrixType::F32 => "f32",
        MatrixType::Bf16 => "bf16",
        MatrixType::F16 => "f16",
    }
}

fn type_of(s: &str) -> Option<MatrixType> {
    Some(match s {
        "f32" => MatrixType::F32,
        "bf16" => MatrixType::Bf16,
        "f16" => MatrixType::F16,
        _ => return None,
    })
}

/// The largest power of two, up to 256, that divides the address `ptr`: the alignment
/// cuBLASLt may assume of the matrix there (256, cuBLASLt's default, for an unused 0).
pub(crate) fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        256
    } else {
        1 << ptr.trailing_zeros().min(8)
    }
}

/// The candidate to run, given each candidate's time in the heuristic's order (`None`
/// where it failed to run): the fastest, unless it beats the heuristic's first choice by
/// less than [`MARGIN`]; the fastest outright when the first failed; `None` when none
/// ran.
pub(crate) fn pick(times: &[Option<f64>]) -> Option<usize> {
    let fastest = times
        .iter()
        .enumerate()
        .filter_map(|(i, t)| Some((i, (*t)?)))
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))?;
    match times.first().copied().flatten() {
        Some(first) if fastest.1 > first * (1.0 - MARGIN) => Some(0),
        _ => Some(fastest.0),
    }
}

/// How a product's algorithm was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChoiceSource {
    /// The heuristic's first choice, untimed: tuning is off, the heuristic offered one
    /// algorithm, or timing could not run (no memory for the scratch output).
    Heuristic,
    /// Timed in this process.
    Timed,
    /// Timed by an earlier process on this machine, read from the saved choices.
    Saved,
}

/// One product's algorithm choice, for reports ([`CudaBackend::product_choices`]).
///
/// [`CudaBackend::product_choices`]: super::CudaBackend::product_choices
#[derive(Clone, Debug, PartialEq)]
pub struct ProductChoice {
    /// The product as per-kernel timing names it (`cublasLt m×n×k` with its epilogue),
    /// with its operands' and output's element types: `cublasLt 768x8192x3072 +gelu, bf16
    /// → bf16`.
    pub name: String,
    /// How the algorithm was chosen.
    pub source: ChoiceSource,
    /// The candidates the heuristic offered (timed where `source` is `Timed`).
    pub candidates: usize,
    /// The chosen candidate's rank in the heuristic's order (0: its first choice).
    pub chosen: usize,
    /// The heuristic's first choice's time per run, in microseconds, where timed.
    pub first_us: Option<f64>,
    /// The chosen candidate's time per run, in microseconds, where timed.
    pub chosen_us: Option<f64>,
}

/// What choosing among a product's candidates needs from the device: a stand-in in
/// tests.
pub(crate) trait Trials {
    /// Whether cuBLASLt still accepts `algo` (saved by an earlier process) for the
    /// product.
    fn fits(&self, algo: &AlgoBytes) -> bool;

    /// Each candidate's time per run in milliseconds, in the heuristic's order (`None`
    /// where it failed to run); an error where timing could not run at all.
    fn time(&self) -> Result<Vec<Option<f64>>>;
}

/// The choices of one device: whether to time, what earlier processes saved, and how
/// each product of this process chose.
#[derive(Debug)]
pub(crate) struct Tuner {
    on: bool,
    saved: Mutex<SavedChoices>,
    choices: Mutex<Vec<ProductChoice>>,
    /// [`MOST_TIMED`] products have been timed, and that was said.
    enough_said: AtomicBool,
}

impl Tuner {
    /// Timing when `on`, with the choices `saved` by earlier processes.
    pub(crate) fn new(on: bool, saved: SavedChoices) -> Tuner {
        Tuner {
            on,
            saved: Mutex::new(saved),
            choices: Mutex::new(Vec::new()),
            enough_said: AtomicBool::new(false),
        }
    }

    /// The heuristic's candidates worth asking for: [`CANDIDATES`] when timing, else 1.
    pub(crate) fn candidates(&self) -> usize {
        if self.on {
            CANDIDATES
        } else {
            1
        }
    }

    /// How each product chose so far, in the order they first ran.
    pub(crate) fn choices(&self) -> Vec<ProductChoice> {
        self.choices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The algorithm product `name` (key `key`) runs, among the heuristic's `candidates`
    /// (at least one, best first), recorded in [`Tuner::choices`]: the heuristic's first
    /// when there is one candidate or timing is off; else the one saved for `key` where
    /// cuBLASLt still accepts it; else, below [`MOST_TIMED`] products timed, the one
    /// [`pick`] takes from `trials`' times, saved; else (or where timing fails) the
    /// heuristic's first.
    pub(crate) fn choose(
        &self,
        name: String,
        key: &GemmKey,
        candidates: &[AlgoBytes],
        trials: &dyn Trials,
    ) -> AlgoBytes {
        let (algo, choice) = self.decide(name, key, candidates, trials);
        self.choices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(choice);
        algo
    }

    fn decide(
        &self,
        name: String,
        key: &GemmKey,
        candidates: &[AlgoBytes],
        trials: &dyn Trials,
    ) -> (AlgoBytes, ProductChoice) {
        let first = candidates[0];
        let untimed = |name| ProductChoice {
            name,
            source: ChoiceSource::Heuristic,
            candidates: candidates.len(),
            chosen: 0,
            first_us: None,
            chosen_us: None,
        };
        if !self.on || candidates.len() < 2 {
            return (first, untimed(name));
        }
        let mut saved = self.saved.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(algo) = saved.get(key) {
            if trials.fits(&algo) {
                let chosen = candidates.iter().position(|c| *c == algo);
                let choice = ProductChoice {
                    source: ChoiceSource::Saved,
                    chosen: chosen.unwrap_or(candidates.len()),
                    ..untimed(name)
                };
                return (algo, choice);
            }
            log::info!("the saved algorithm of {name} no longer runs it: timing again");
        }
        let timed = self
            .choices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|c| c.source == ChoiceSource::Timed)
            .count();
        if timed >= MOST_TIMED {
            if !self.enough_said.swap(true, Ordering::Relaxed) {
                log::info!(
                    "{MOST_TIMED} products timed in this process: the heuristic's first \
                     algorithm, untimed, for new shapes from {name} on"
                );
            }
            return (first, untimed(name));
        }
        let times = match trials.time() {
            Ok(times) => times,
            Err(e) => {
                log::info!("{name}: the heuristic's first algorithm, untimed ({e})");
                return (first, untimed(name));
            }
        };
        let Some(chosen) = pick(&times) else {
            return (first, untimed(name));
        };
        let algo = candidates[chosen];
        if let Err(e) = saved.insert(*key, algo) {
            log::warn!("the product choices could not be saved ({e}); they hold for this run");
        }
        let us = |i: usize| times.get(i).copied().flatten().map(|ms| ms * 1e3);
        let choice = ProductChoice {
            source: ChoiceSource::Timed,
            chosen,
            first_us: us(0),
            chosen_us: us(chosen),
            ..untimed(name)
        };
        (algo, choice)
    }
}

/// Identifies the device and library the saved choices hold for: an algorithm chosen on
/// one device model, cuBLASLt version or workspace size says nothing of another.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ChoiceDevice {
    /// The device's name (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// Its compute capability.
    pub compute_capability: (i32, i32),
    /// `cublasLtGetVersion()`.
    pub cublaslt: usize,
    /// The workspace the products may use.
    pub workspace_bytes: usize,
}

impl ChoiceDevice {
    /// The file the choices of this device go in: one per device model, library and
    /// workspace, so that machines sharing a cache directory keep theirs apart.
    fn file_name(&self) -> String {
        let slug: String = self
            .name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        format!(
            "products-{slug}-sm{}{}-cublaslt{}-ws{}.txt",
            self.compute_capability.0,
            self.compute_capability.1,
            self.cublaslt,
            self.workspace_bytes
        )
    }

    /// The file's second line.
    fn header(&self) -> String {
        format!(
            "device\t{}\tsm_{}{}\tcublasLt {}\tworkspace {}",
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.cublaslt,
            self.workspace_bytes
        )
    }
}

/// An algorithm as cuBLASLt hands it out: an opaque 64-byte value
/// (`cublasLtMatmulAlgo_t`), which it documents as safe to store and reuse with the same
/// library version and device.
pub(crate) type AlgoBytes = [u64; 8];

const TITLE: &str = "# trainkit: cuBLASLt algorithms chosen by timing, one product a line";

/// The choices saved for one device: read once when the backend opens, written whole
/// (atomically) whenever a product is timed. Without a cache directory they live only in
/// the process.
#[derive(Debug)]
pub(crate) struct SavedChoices {
    path: Option<PathBuf>,
    header: String,
    entries: BTreeMap<GemmKey, AlgoBytes>,
}

impl SavedChoices {
    /// The choices saved in `dir` for `device` (none where `dir` is `None`, the file is
    /// missing, or it was written for another device). A line that does not read is
    /// skipped, and said once.
    pub(crate) fn open(dir: Option<&Path>, device: &ChoiceDevice) -> SavedChoices {
        let path = dir.map(|d| d.join(device.file_name()));
        let header = device.header();
        let entries = match path.as_deref().map(std::fs::read_to_string) {
            Some(Ok(text)) => parse(&text, &header, path.as_deref()),
            _ => BTreeMap::new(),
        };
        SavedChoices {
            path,
            header,
            entries,
        }
    }

    /// The algorithm saved for `key`.
    pub(crate) fn get(&self, key: &GemmKey) -> Option<AlgoBytes> {
        self.entries.get(key).copied()
    }

    /// Products saved.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }

    /// Keeps `algo` for `key` and writes the file anew, when there is one, with the
    /// products another process (a rank beside this one) saved there since it was read.
    pub(crate) fn insert(&mut self, key: GemmKey, algo: AlgoBytes) -> Result<()> {
        self.entries.insert(key, algo);
        let Some(path) = &self.path else {
            return Ok(());
        };
        if let Ok(text) = std::fs::read_to_string(path) {
            for (k, a) in parse(&text, &self.header, Some(path)) {
                self.entries.entry(k).or_insert(a);
            }
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| crate::error::Error::io(dir, e))?;
        }
        crate::save::atomic::write_atomically(path, render(&self.header, &self.entries).as_bytes())
    }
}

impl PartialOrd for GemmKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for GemmKey {
    /// By the saved line, so that the file lists its products in a stable order.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.line().cmp(&other.line())
    }
}

/// The file's text: the title, the device line, then `key<TAB>algorithm` per product,
/// the algorithm as eight 16-digit hexadecimal words.
fn render(header: &str, entries: &BTreeMap<GemmKey, AlgoBytes>) -> String {
    let mut out = format!("{TITLE}\n{header}\n");
    for (key, algo) in entries {
        let words: Vec<String> = algo.iter().map(|w| format!("{w:016x}")).collect();
        out.push_str(&format!("{}\t{}\n", key.line(), words.join(" ")));
    }
    out
}

/// The entries of a file [`render`] wrote for the device of `header`; none when it was
/// written for another device.
fn parse(text: &str, header: &str, path: Option<&Path>) -> BTreeMap<GemmKey, AlgoBytes> {
    let mut lines = text.lines();
    let mut entries = BTreeMap::new();
    if lines.next() != Some(TITLE) || lines.next() != Some(header) {
        return entries;
    }
    let mut skipped = 0;
    for line in lines {
        let entry = line.split_once('\t').and_then(|(key, algo)| {
            let words: Vec<u64> = algo
                .split(' ')
                .map(|w| (w.len() == 16).then(|| u64::from_str_radix(w, 16).ok())?)
                .collect::<Option<_>>()?;
            Some((GemmKey::parse(key)?, <AlgoBytes>::try_from(words).ok()?))
        });
        match entry {
            Some((key, algo)) => {
                entries.insert(key, algo);
            }
            None => skipped += 1,
        }
    }
    if skipped > 0 {
        log::warn!(
            "{} line(s) of the saved product choices {} do not read; those products will \
             be timed again",
            skipped,
            path.map_or_else(|| "(no file)".into(), |p| p.display().to_string())
        );
    }
    entries
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(m: u64, accumulate: bool) -> GemmKey {
        let l = |ty, rows, cols| MatrixLayout {
            ty,
            rows,
            cols,
            ld: rows as i64,
        };
        GemmKey {
            trans_a: true,
            trans_b: false,
            a: l(MatrixType::Bf16, 768, m),
            b: l(MatrixType::Bf16, 768, 8192),
            d: l(MatrixType::F32, m, 8192),
            bias: false,
            gelu: true,
            dgelu: false,
            bias_grad: 2,
            tf32: false,
            accumulate,
            align: [256, 128, 16, 16],
        }
    }

    fn device() -> ChoiceDevice {
        ChoiceDevice {
            name: "NVIDIA H100 80GB HBM3".into(),
            compute_capability: (9, 0),
            cublaslt: 130100,
            workspace_bytes: 32 << 20,
        }
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "trainkit-product-choices-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn the_heuristics_first_choice_stays_unless_another_is_clearly_faster() {
        // Within the margin: the first stays.
        assert_eq!(pick(&[Some(100.0), Some(98.0), Some(99.0)]), Some(0));
        // Past it: the fastest.
        assert_eq!(pick(&[Some(100.0), Some(90.0), Some(80.0)]), Some(2));
        // The first failed: the fastest of the rest.
        assert_eq!(pick(&[None, Some(90.0), Some(95.0)]), Some(1));
        // Ties go to the earlier rank.
        assert_eq!(pick(&[Some(100.0), Some(50.0), Some(50.0)]), Some(1));
        assert_eq!(pick(&[Some(100.0)]), Some(0));
        assert_eq!(pick(&[None, None]), None);
        assert_eq!(pick(&[]), None);
    }

    #[test]
    fn a_key_reads_back_from_its_line() {
        for k in [key(768, false), key(50304, true)] {
            let line = k.line();
            assert!(!line.contains('\t') && !line.contains('\n'));
            assert_eq!(GemmKey::parse(&line), Some(k), "{line}");
        }
        assert_eq!(
            key(768, true).line(),
            "T N bf16:768x768:768 bf16:768x8192:768 f32:768x8192:768 bias=0 gelu=1 dgelu=0 \
             bias_grad=2 tf32=0 accumulate=1 align=256,128,16,16"
        );
        let line = key(768, false).line();
        for bad in [
            String::new(),
            line.replace("bf16:", "f8:"),
            line.replace("bias_grad=2", "bias_grad=3"),
            line.replace("gelu=1", "gelu=yes"),
            line.replace("align=256,128,16,16", "align=256,128,16"),
            line.replace("align=256,128,16,16", "align=256,128,16,16,8"),
            line.replace("T N", "X N"),
            format!("{line} extra"),
        ] {
            assert_eq!(GemmKey::parse(&bad), None, "{bad}");
        }
    }

    #[test]
    fn choices_are_saved_per_device_and_read_back() {
        let dir = temp_dir("roundtrip");
        let dev = device();
        let mut saved = SavedChoices::open(Some(&dir), &dev);
        assert_eq!(saved.len(), 0);
        let algo: AlgoBytes = [1, 2, 3, u64::MAX, 0, 5, 6, 0x0123_4567_89ab_cdef];
        saved.insert(key(768, false), algo).unwrap();
        saved.insert(key(50304, true), [7; 8]).unwrap();
        let again = SavedChoices::open(Some(&dir), &dev);
        assert_eq!(again.len(), 2);
        assert_eq!(again.get(&key(768, false)), Some(algo));
        assert_eq!(again.get(&key(50304, true)), Some([7; 8]));
        assert_eq!(again.get(&key(768, true)), None);
        // Another library version, workspace or device keeps its own file.
        for other in [
            ChoiceDevice {
                cublaslt: 130000,
                ..device()
            },
            ChoiceDevice {
                workspace_bytes: 4 << 20,
                ..device()
            },
            ChoiceDevice {
                name: "NVIDIA H200".into(),
                ..device()
            },
        ] {
            assert_eq!(SavedChoices::open(Some(&dir), &other).len(), 0, "{other:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_damaged_file_loses_only_its_damaged_lines() {
        let dir = temp_dir("damaged");
        let dev = device();
        let mut saved = SavedChoices::open(Some(&dir), &dev);
        saved.insert(key(768, false), [9; 8]).unwrap();
        saved.insert(key(50304, true), [7; 8]).unwrap();
        let path = dir.join(dev.file_name());
        let text = std::fs::read_to_string(&path).unwrap();
        let mut lines: Vec<String> = text.lines().map(String::from).collect();
        assert_eq!(lines.len(), 4, "{text}");
        // One line cut short, and garbage appended.
        let cut = lines[3].len() - 3;
        lines[3].truncate(cut);
        lines.push("not a product".into());
        std::fs::write(&path, lines.join("\n")).unwrap();
        let read = SavedChoices::open(Some(&dir), &dev);
        assert_eq!(read.len(), 1);
        // Whichever line survived reads whole.
        let survivor = GemmKey::parse(lines[2].split('\t').next().unwrap()).unwrap();
        assert!(read.get(&survivor).is_some());
        // A file whose device line is not this device's is someone else's: nothing read.
        std::fs::write(&path, text.replace("sm_90", "sm_80")).unwrap();
        assert_eq!(SavedChoices::open(Some(&dir), &dev).len(), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn two_processes_saving_at_once_keep_both_their_choices() {
        let dir = temp_dir("two");
        let dev = device();
        let mut one = SavedChoices::open(Some(&dir), &dev);
        let mut two = SavedChoices::open(Some(&dir), &dev);
        one.insert(key(768, false), [1; 8]).unwrap();
        two.insert(key(50304, true), [2; 8]).unwrap();
        // The same product timed by both: the process keeps its own choice.
        two.insert(key(768, false), [3; 8]).unwrap();
        let read = SavedChoices::open(Some(&dir), &dev);
        assert_eq!(read.len(), 2);
        assert_eq!(read.get(&key(50304, true)), Some([2; 8]));
        assert_eq!(read.get(&key(768, false)), Some([3; 8]));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A device for [`Tuner`]: preset times (or a failure) and cuBLASLt's verdict on a
    /// saved algorithm, counting the timings asked for.
    struct Fake {
        fits: bool,
        times: Option<Vec<Option<f64>>>,
        timings: std::cell::Cell<usize>,
    }

    impl Fake {
        fn new(times: Option<Vec<Option<f64>>>) -> Fake {
            Fake {
                fits: true,
                times,
                timings: std::cell::Cell::new(0),
            }
        }
    }

    impl Trials for Fake {
        fn fits(&self, _: &AlgoBytes) -> bool {
            self.fits
        }

        fn time(&self) -> Result<Vec<Option<f64>>> {
            self.timings.set(self.timings.get() + 1);
            self.times
                .clone()
                .ok_or_else(|| crate::error::Error::Backend {
                    backend: "cuda",
                    message: "no room for a scratch output".into(),
                })
        }
    }

    const THREE: [AlgoBytes; 3] = [[10; 8], [11; 8], [12; 8]];

    #[test]
    fn a_tuner_times_a_new_product_once_and_a_later_process_reads_its_choice() {
        let dir = temp_dir("tuner");
        let tuner = Tuner::new(true, SavedChoices::open(Some(&dir), &device()));
        let fake = Fake::new(Some(vec![Some(0.100), Some(0.080), Some(0.090)]));
        let k = key(768, true);
        assert_eq!(tuner.choose("p".into(), &k, &THREE, &fake), THREE[1]);
        assert_eq!(fake.timings.get(), 1);
        let c = &tuner.choices()[0];
        assert_eq!(
            (c.source, c.chosen, c.candidates),
            (ChoiceSource::Timed, 1, 3)
        );
        assert_eq!(c.first_us.map(f64::round), Some(100.0));
        assert_eq!(c.chosen_us.map(f64::round), Some(80.0));
        // The next process takes the saved choice without timing.
        let later = Tuner::new(true, SavedChoices::open(Some(&dir), &device()));
        let fake = Fake::new(None);
        assert_eq!(later.choose("p".into(), &k, &THREE, &fake), THREE[1]);
        assert_eq!(fake.timings.get(), 0);
        let c = &later.choices()[0];
        assert_eq!((c.source, c.chosen), (ChoiceSource::Saved, 1));
        // A saved algorithm the heuristic no longer offers still runs, if cuBLASLt takes it.
        let fewer = Tuner::new(true, SavedChoices::open(Some(&dir), &device()));
        assert_eq!(
            fewer.choose("p".into(), &k, &[[1; 8], [2; 8]], &fake),
            THREE[1]
        );
        assert_eq!(
            fewer.choices()[0].chosen,
            2,
            "past the candidates: not among them"
        );
        // One cuBLASLt refuses is timed again.
        let refused = Tuner::new(true, SavedChoices::open(Some(&dir), &device()));
        let fake = Fake {
            fits: false,
            ..Fake::new(Some(vec![Some(0.05), Some(0.08), Some(0.09)]))
        };
        assert_eq!(refused.choose("p".into(), &k, &THREE, &fake), THREE[0]);
        assert_eq!(fake.timings.get(), 1);
        assert_eq!(refused.choices()[0].source, ChoiceSource::Timed);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_tuner_takes_the_heuristics_first_untimed_when_it_cannot_or_need_not_time() {
        let untimed = |tuner: &Tuner, candidates: &[AlgoBytes], fake: &Fake| {
            let algo = tuner.choose("p".into(), &key(768, false), candidates, fake);
            let last = tuner.choices().pop().unwrap();
            assert_eq!(
                (algo, last.source),
                (candidates[0], ChoiceSource::Heuristic)
            );
            assert_eq!(last.first_us, None);
        };
        let times = || Some(vec![Some(0.2), Some(0.1), Some(0.1)]);
        // Timing off: one candidate asked for, none timed.
        let off = Tuner::new(false, SavedChoices::open(None, &device()));
        assert_eq!(off.candidates(), 1);
        let fake = Fake::new(times());
        untimed(&off, &THREE, &fake);
        assert_eq!(fake.timings.get(), 0);
        let on = Tuner::new(true, SavedChoices::open(None, &device()));
        assert_eq!(on.candidates(), CANDIDATES);
        // One candidate: nothing to choose.
        untimed(&on, &THREE[..1], &fake);
        assert_eq!(fake.timings.get(), 0);
        // Timing failed (no memory for the scratch output), or no candidate ran.
        untimed(&on, &THREE, &Fake::new(None));
        untimed(&on, &THREE, &Fake::new(Some(vec![None, None, None])));
        // Past MOST_TIMED products timed in the process.
        for i in 0..MOST_TIMED as u64 {
            on.choose("q".into(), &key(1000 + i, false), &THREE, &fake);
        }
        assert_eq!(fake.timings.get(), MOST_TIMED);
        untimed(&on, &THREE, &fake);
        assert_eq!(fake.timings.get(), MOST_TIMED);
    }

    #[test]
    fn without_a_cache_directory_choices_stay_in_the_process() {
        let mut saved = SavedChoices::open(None, &device());
        saved.insert(key(768, false), [1; 8]).unwrap();
        assert_eq!(saved.get(&key(768, false)), Some([1; 8]));
    }

    #[test]
    fn a_file_name_is_a_plain_name() {
        let name = device().file_name();
        assert_eq!(
            name,
            "products-NVIDIA-H100-80GB-HBM3-sm90-cublaslt130100-ws33554432.txt"
        );
        assert!(name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.'));
    }

    #[test]
    fn alignment_is_the_largest_power_of_two_dividing_the_address_up_to_256() {
        assert_eq!(alignment(0), 256);
        assert_eq!(alignment(0x7f00_0000_0000), 256);
        assert_eq!(alignment(0x7f00_0000_0080), 128);
        assert_eq!(alignment(0x7f00_0000_0006), 2);
        assert_eq!(alignment(0x7f00_0000_0001), 1);
    }
}
