//! Crash-safe writes: a file appears whole or not at all, and a directory is replaced in
//! one rename.

use crate::error::{Error, Result};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Writes `bytes` to `path` through a temporary file in the same directory (a fresh
/// name for every call), flushed to disk before it is renamed over `path`; the rename is
/// then made durable by flushing the directory. `path` holds either its old contents or
/// the whole new file, never a part. The parent directory must exist.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomically_with(path, |tmp| {
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(tmp)?
            .write_all(bytes)
    })
}

/// [`write_atomically`] of the file `write` creates at the temporary path it is given
/// (a fresh name for every call), so that a large file can be written piece by piece,
/// never whole in memory.
pub fn write_atomically_with(
    path: &Path,
    write: impl FnOnce(&Path) -> std::io::Result<()>,
) -> Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let tmp = temp_sibling(path, &format!("{n}.tmp"));
    let result = (|| {
        write(&tmp)?;
        fs::File::open(&tmp)?.sync_all()?;
        fs::rename(&tmp, path)
    })();
    result.map_err(|e| {
        let _ = fs::remove_file(&tmp);
        Error::io(path, e)
    })?;
    sync_dir(parent_dir(path));
    Ok(())
}

/// Builds a directory beside its target and swaps it in by [`DirectoryWriter::commit`]:
/// until then the previous contents of the target stay untouched.
#[derive(Debug)]
pub struct DirectoryWriter {
    target: PathBuf,
    staging: PathBuf,
    /// Files of the old target that what is written replaces even where it writes no file
    /// of that name (a model's files supersede an adapter's): not carried over.
    superseded: Vec<String>,
}

impl DirectoryWriter {
    /// Starts writing `target` (its parent directories are created).
    pub fn new(target: &Path) -> Result<Self> {
        create_parents(target)?;
        recover_directory(target)?;
        let staging = temp_sibling(target, "partial");
        fs::create_dir(&staging).map_err(|e| Error::io(&staging, e))?;
        Ok(DirectoryWriter {
            target: target.to_path_buf(),
            staging,
            superseded: Vec::new(),
        })
    }

    /// Files of the old target not to carry over into the new one: what is written
    /// supersedes them (a full model saved where an adapter was: transformers would
    /// otherwise load the stale adapter on top of it). Each one dropped is named in a
    /// warning.
    pub fn supersede(&mut self, names: &[&str]) {
        self.superseded.extend(names.iter().map(|n| n.to_string()));
    }

    /// Where to write the file called `name`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.staging.join(name)
    }

    /// Writes the file called `name`.
    pub fn write(&self, name: &str, bytes: &[u8]) -> Result<()> {
        write_atomically(&self.path(name), bytes)
    }

    /// Replaces the target with what was written. On Linux the two directories are
    /// exchanged in one atomic `renameat2(RENAME_EXCHANGE)`, so the target is never
    /// missing; elsewhere (or on a filesystem without it) the old target is renamed aside,
    /// the new one renamed in, and [`recover_directory`] undoes a crash in between. Files
    /// in the old target that this writer did not produce (a user's notes, a tokenizer)
    /// are carried over.
    pub fn commit(self) -> Result<()> {
        let io = |p: &Path| {
            let p = p.to_path_buf();
            move |e| Error::io(p, e)
        };
        if self.target.exists() && !self.target.is_dir() {
            return Err(Error::data(
                self.target.display().to_string(),
                "exists and is not a directory; choose another output directory",
            ));
        }
        if self.target.is_dir() {
            for entry in fs::read_dir(&self.target).map_err(io(&self.target))? {
                let entry = entry.map_err(io(&self.target))?;
                let dest = self.staging.join(entry.file_name());
                if !dest.exists() && entry.file_type().map_err(io(&entry.path()))?.is_file() {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    if self.superseded.contains(&name) {
                        log::warn!(
                            "{}: the previous {name} was removed: what was saved there now \
                             supersedes it",
                            self.target.display()
                        );
                        continue;
                    }
                    fs::copy(entry.path(), &dest).map_err(io(&dest))?;
                }
            }
            sync_dir(&self.staging);
            if exchange(&self.staging, &self.target).is_ok() {
                sync_dir(parent_dir(&self.target));
                fs::remove_dir_all(&self.staging).map_err(io(&self.staging))?;
                return Ok(());
            }
            let old = temp_sibling(&self.target, "old");
            if old.exists() {
                fs::remove_dir_all(&old).map_err(io(&old))?;
            }
            fs::rename(&self.target, &old).map_err(io(&self.target))?;
            fs::rename(&self.staging, &self.target).map_err(io(&self.target))?;
            sync_dir(parent_dir(&self.target));
            fs::remove_dir_all(&old).map_err(io(&old))?;
        } else {
            sync_dir(&self.staging);
            fs::rename(&self.staging, &self.target).map_err(io(&self.target))?;
            sync_dir(parent_dir(&self.target));
        }
        Ok(())
    }
}

/// Whether a directory can be saved as `target` ([`DirectoryWriter`]): it is not a file,
/// its parent directories are created, and a staging directory is made beside it and
/// removed again. A run that will save there calls it before it trains, so that a place
/// it cannot write is found then, not at its first save.
pub fn check_writable_dir(target: &Path) -> Result<()> {
    if target.exists() && !target.is_dir() {
        let kind = std::io::ErrorKind::AlreadyExists;
        return Err(Error::io(
            target,
            std::io::Error::new(kind, "exists and is not a directory"),
        ));
    }
    create_parents(target)?;
    let probe = temp_sibling(target, "probe");
    fs::create_dir(&probe).map_err(|e| Error::io(parent_dir(target), e))?;
    fs::remove_dir(&probe).map_err(|e| Error::io(&probe, e))
}

/// Creates the directories `target` lies in.
fn create_parents(target: &Path) -> Result<()> {
    match target.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(parent) => fs::create_dir_all(parent).map_err(|e| Error::io(parent, e)),
        None => Ok(()),
    }
}

/// Repairs what an interrupted save can leave beside `target`: when `target` is missing
/// but the previous checkpoint was set aside (`.NAME.PID.old`), it is renamed back; stale
/// staging directories (`.NAME.PID.partial`) of saves that never finished, and the probes
/// of [`check_writable_dir`], are removed.
/// Returns whether a checkpoint was restored.
pub fn recover_directory(target: &Path) -> Result<bool> {
    let Some(name) = target.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return Ok(false);
    };
    let Ok(entries) = fs::read_dir(parent_dir(target)) else {
        return Ok(false);
    };
    let prefix = format!(".{name}.");
    let mut restored = false;
    for entry in entries.flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = file.strip_prefix(&prefix) else {
            continue;
        };
        let path = entry.path();
        if rest.ends_with(".old") && !target.exists() {
            fs::rename(&path, target).map_err(|e| Error::io(&path, e))?;
            log::warn!(
                "{}: restored the previous checkpoint from {} (a save was interrupted)",
                target.display(),
                path.display()
            );
            restored = true;
        } else if [".partial", ".old", ".probe"]
            .iter()
            .any(|s| rest.ends_with(s))
        {
            fs::remove_dir_all(&path).map_err(|e| Error::io(&path, e))?;
        }
    }
    Ok(restored)
}

/// Swaps two directories atomically.
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let a = CString::new(a.as_os_str().as_bytes())?;
    let b = CString::new(b.as_os_str().as_bytes())?;
    // SAFETY: both paths are valid NUL-terminated strings for the duration of the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Swaps two directories atomically (unsupported here: the caller falls back).
#[cfg(not(target_os = "linux"))]
fn exchange(_: &Path, _: &Path) -> std::io::Result<()> {
    Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
}

/// Flushes a directory's entries to disk (best effort: not every platform can).
fn sync_dir(dir: &Path) {
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// The directory holding `path` (`.` for a bare file name).
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// `dir/.name.suffix` beside `path`, unique to this process.
fn temp_sibling(path: &Path, suffix: &str) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    path.with_file_name(format!(".{name}.{}.{suffix}", std::process::id()))
}
