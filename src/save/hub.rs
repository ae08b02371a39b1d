//! Models named by their Hugging Face id (`--init-from org/name`, `org/name@revision`):
//! found in the local Hugging Face cache, laid out as `huggingface_hub` and transformers
//! leave it (`models--org--name/refs/REVISION` holding a commit, the files under
//! `snapshots/COMMIT/`), or downloaded into it with the `hf-hub` crate (the `hub`
//! feature, on by default) when the network allows.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// A model id and the revision asked for (`main` unless `@revision` is given).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelId {
    /// `org/name`.
    pub repo: String,
    /// A branch, tag or commit.
    pub revision: String,
}

impl ModelId {
    /// `spec` as a model id: `org/name` or `org/name@revision`, each part of letters,
    /// digits, `-`, `_` and `.` (not starting with `.`); `None` for anything else (a path).
    pub fn parse(spec: &str) -> Option<ModelId> {
        let (repo, revision) = match spec.split_once('@') {
            Some((repo, rev)) if !rev.is_empty() => (repo, rev),
            Some(_) => return None,
            None => (spec, "main"),
        };
        let (org, name) = repo.split_once('/')?;
        let part = |p: &str| {
            !p.is_empty()
                && !p.starts_with('.')
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        (part(org) && part(name)).then(|| ModelId {
            repo: repo.to_string(),
            revision: revision.to_string(),
        })
    }

    /// The repository's directory in the cache: `models--org--name`.
    fn cache_folder(&self) -> String {
        format!("models--{}", self.repo.replace('/', "--"))
    }
}

/// The Hugging Face hub cache: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
/// `~/.cache/huggingface/hub` (`$XDG_CACHE_HOME/huggingface/hub` when that is set).
pub fn cache_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = var("HF_HUB_CACHE") {
        return dir;
    }
    if let Some(home) = var("HF_HOME") {
        return home.join("hub");
    }
    let cache = var("XDG_CACHE_HOME")
        .or_else(|| var("HOME").map(|h| h.join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    cache.join("huggingface").join("hub")
}

/// The snapshot directory of `id` in the cache at `cache`, when it holds the model's
/// `config.json`: the revision through `refs/`, or a commit's snapshot directly.
pub fn cached_snapshot(cache: &Path, id: &ModelId) -> Option<PathBuf> {
    let repo = cache.join(id.cache_folder());
    let commit = std::fs::read_to_string(repo.join("refs").join(&id.revision))
        .map(|c| c.trim().to_string())
        .unwrap_or_else(|_| id.revision.clone());
    let snapshot = repo.join("snapshots").join(commit);
    snapshot
        .join(crate::save::CONFIG_FILE)
        .is_file()
        .then_some(snapshot)
}

/// The directory of the model `spec` names: `spec` itself when it is a directory (or
/// does not look like a model id), else the cached snapshot of the model id, downloaded
/// first when the cache lacks it (with the `hub` feature). Errors name the id, the cache
/// searched and how to get the model.
pub fn resolve_model(spec: &Path) -> Result<PathBuf> {
    if spec.is_dir() {
        return Ok(spec.to_path_buf());
    }
    let Some(id) = spec.to_str().and_then(ModelId::parse) else {
        return Ok(spec.to_path_buf());
    };
    let cache = cache_dir();
    if let Some(dir) = cached_snapshot(&cache, &id) {
        return Ok(dir);
    }
    download(&cache, &id)
}

#[cfg(feature = "hub")]
fn download(cache: &Path, id: &ModelId) -> Result<PathBuf> {
    use hf_hub::api::sync::ApiBuilder;
    use hf_hub::{Repo, RepoType};
    let failed =
        |e: &dyn std::fmt::Display| not_found(cache, id, &format!("the download failed ({e})"));
    let mut builder = ApiBuilder::new()
        .with_cache_dir(cache.to_path_buf())
        .with_progress(true);
    // A mirror, as huggingface_hub reads it.
    if let Some(endpoint) = std::env::var("HF_ENDPOINT").ok().filter(|e| !e.is_empty()) {
        builder = builder.with_endpoint(endpoint);
    }
    let api = builder.build().map_err(|e| failed(&e))?;
    let repo = api.repo(Repo::with_revision(
        id.repo.clone(),
        RepoType::Model,
        id.revision.clone(),
    ));
    let info = repo.info().map_err(|e| failed(&e))?;
    let listed = |name: &str| info.siblings.iter().any(|s| s.rfilename == name);
    let weights: Vec<String> = if listed(crate::save::WEIGHTS_FILE) {
        vec![crate::save::WEIGHTS_FILE.to_string()]
    } else if listed(crate::save::WEIGHTS_INDEX_FILE) {
        let mut files: Vec<String> = info
            .siblings
            .iter()
            .map(|s| s.rfilename.clone())
            .filter(|f| f.ends_with(".safetensors") && !f.contains('/'))
            .collect();
        files.push(crate::save::WEIGHTS_INDEX_FILE.to_string());
        files
    } else {
        return Err(not_found(
            cache,
            id,
            "the repository has no model.safetensors (nor an index of shards): trainkit reads \
             safetensors weights",
        ));
    };
    let mut config = None;
    for file in crate::save::MODEL_SIDE_FILES
        .iter()
        .map(|f| f.to_string())
        .chain(weights)
    {
        if !listed(&file) {
            continue;
        }
        log::info!("downloading {} {file}", id.repo);
        let path = repo.get(&file).map_err(|e| failed(&e))?;
        if file == crate::save::CONFIG_FILE {
            config = path.parent().map(Path::to_path_buf);
        }
    }
    config.ok_or_else(|| not_found(cache, id, "the repository has no config.json"))
}

#[cfg(not(feature = "hub"))]
fn download(cache: &Path, id: &ModelId) -> Result<PathBuf> {
    Err(not_found(
        cache,
        id,
        "this build has no downloader (the `hub` feature is off)",
    ))
}

/// The error for a model id that could not be resolved.
fn not_found(cache: &Path, id: &ModelId, why: &str) -> Error {
    Error::data(
        format!("--init-from {}@{}", id.repo, id.revision),
        format!(
            "is not in the Hugging Face cache {} and {why}; download it where the network \
             allows (`hf download {}`, or `huggingface-cli download`) into that cache \
             (HF_HOME or HF_HUB_CACHE), or pass the model's directory",
            cache.display(),
            id.repo
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_ids_are_told_from_paths() {
        let id = |s: &str| ModelId::parse(s).map(|m| (m.repo, m.revision));
        assert_eq!(
            id("Qwen/Qwen2.5-0.5B"),
            Some(("Qwen/Qwen2.5-0.5B".into(), "main".into()))
        );
        assert_eq!(id("org/m_1@v2.0"), Some(("org/m_1".into(), "v2.0".into())));
        for path in [
            "model",
            "./org/name",
            "/abs/path",
            "a/b/c",
            "org/",
            "../x",
            "o/n@",
        ] {
            assert_eq!(id(path), None, "{path}");
        }
    }
}
