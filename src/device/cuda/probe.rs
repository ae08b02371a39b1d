//! Whether a usable NVIDIA GPU is present, and what it is.
//!
//! The probe checks each CUDA library before calling into it (cudarc panics on the first
//! call into a library it cannot load), in the order the backend needs them: the driver,
//! NVRTC, cuBLASLt; then the driver's CUDA version (NVRTC 13.0's code needs a CUDA 13.0
//! driver, 580 or newer) and that NVRTC is no newer than the driver; only then does it
//! create a context on the device and read its name, compute capability and memory.
//! Whatever is missing comes back as a sentence saying what and how to fix it.

use std::fmt;

/// What the probe found on a GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaInfo {
    /// Device ordinal (0 for [`probe`]).
    pub ordinal: usize,
    /// Device name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Compute capability `(major, minor)`: `(9, 0)` on Hopper.
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_memory: u64,
    /// Free device memory in bytes when probed.
    pub free_memory: u64,
    /// The driver's CUDA version as the driver reports it (13000 for 13.0).
    pub driver_version: i32,
}

impl CudaInfo {
    /// The NVRTC architecture of this device, `sm_XY` (`sm_90` on Hopper).
    pub fn arch(&self) -> String {
        format!(
            "sm_{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }
}

impl fmt::Display for CudaInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const GIB: f64 = (1u64 << 30) as f64;
        write!(
            f,
            "cuda:{} {} ({}, {:.1} GiB, {:.1} GiB free, driver CUDA {}.{})",
            self.ordinal,
            self.name,
            self.arch(),
            self.total_memory as f64 / GIB,
            self.free_memory as f64 / GIB,
            self.driver_version / 1000,
            self.driver_version % 1000 / 10
        )
    }
}

/// The oldest driver CUDA version whose driver loads NVRTC 13.0's PTX (`.version 9.0`).
pub const MIN_DRIVER_VERSION: i32 = 13000;

/// Probes device 0: its description, or why it cannot be used, as a sentence.
pub fn probe() -> Result<CudaInfo, String> {
    probe_device(0)
}

/// Probes device `ordinal` (see [`probe`]).
pub fn probe_device(ordinal: usize) -> Result<CudaInfo, String> {
    check_libraries()?;
    let driver_version = driver_version()?;
    if driver_version < MIN_DRIVER_VERSION {
        return Err(format!(
            "the NVIDIA driver supports CUDA {}.{}, and trainkit's kernels (compiled by NVRTC \
             13.0) need CUDA 13.0: update the driver to 580 or newer",
            driver_version / 1000,
            driver_version % 1000 / 10
        ));
    }
    let nvrtc = super::nvrtc::Nvrtc::get()?;
    super::nvrtc::check_against_driver(nvrtc.version(), nvrtc.path(), driver_version)?;
    // The libraries are present, so cudarc should return errors rather than panic; a
    // driver too old for a symbol cudarc binds would still panic, so catch that too.
    let described = std::panic::catch_unwind(|| describe(ordinal, driver_version));
    match described {
        Ok(result) => result,
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("unknown failure");
            Err(format!(
                "the CUDA driver failed while probing cuda:{ordinal}: {what}"
            ))
        }
    }
}

/// Fails with a reason unless every CUDA library the backend uses can be loaded, checked
/// in order: the driver (cudarc's), then NVRTC and cuBLASLt, which trainkit opens itself
/// by their versioned names ([`super::libraries`]).
fn check_libraries() -> Result<(), String> {
    // SAFETY: only tries to dlopen the library by its usual names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(
            "the CUDA driver library (libcuda.so) was not found: this machine has no \
                    NVIDIA driver, or its library is not on the loader's path"
                .to_string(),
        );
    }
    super::nvrtc::Nvrtc::get()?;
    super::cublaslt::CublasLt::get()?;
    Ok(())
}

/// The driver's CUDA version (needs no context).
fn driver_version() -> Result<i32, String> {
    let mut version = 0;
    // SAFETY: the driver library is present (checked first); the pointer is valid.
    let status = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
    match status {
        cudarc::driver::sys::CUresult::CUDA_SUCCESS => Ok(version),
        other => Err(format!(
            "the CUDA driver could not report its version ({other:?})"
        )),
    }
}

/// Creates a context on `ordinal` and reads what the backend needs.
fn describe(ordinal: usize, driver_version: i32) -> Result<CudaInfo, String> {
    let fail = |what: &str, e: cudarc::driver::DriverError| {
        format!("the CUDA driver could not {what} cuda:{ordinal} ({e})")
    };
    let count = cudarc::driver::CudaContext::device_count().map_err(|e| {
        format!("the CUDA driver did not start ({e}): is an NVIDIA GPU visible to this process?")
    })?;
    if ordinal as i64 >= count as i64 {
        return Err(match count {
            0 => "the CUDA driver sees no GPU".to_string(),
            n => format!("cuda:{ordinal} does not exist: the CUDA driver sees {n} GPU(s)"),
        });
    }
    let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| fail("open", e))?;
    let name = ctx.name().map_err(|e| fail("name", e))?;
    let compute_capability = ctx
        .compute_capability()
        .map_err(|e| fail("read the compute capability of", e))?;
    supported_architecture(&name, compute_capability)?;
    let (free, total) = ctx
        .mem_get_info()
        .map_err(|e| fail("read the memory of", e))?;
    Ok(CudaInfo {
        ordinal,
        name,
        compute_capability,
        total_memory: total as u64,
        free_memory: free as u64,
        driver_version,
    })
}

/// The oldest compute capability NVRTC 13 compiles for: sm_75 (Turing).
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (7, 5);

/// Fails, with a sentence naming the GPU, its architecture and the floor, for a GPU older
/// than [`MIN_COMPUTE_CAPABILITY`]: NVRTC 13 refuses to compile for it, so the backend
/// would fail at its first kernel.
pub fn supported_architecture(name: &str, cc: (i32, i32)) -> std::result::Result<(), String> {
    if cc >= MIN_COMPUTE_CAPABILITY {
        return Ok(());
    }
    let (major, minor) = MIN_COMPUTE_CAPABILITY;
    Err(format!(
        "{name} is sm_{}{}; trainkit's kernels are compiled by NVRTC 13, which targets \
         sm_{major}{minor} (Turing) and newer: train on the CPU (--device cpu) or a newer GPU",
        cc.0, cc.1
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_older_than_turing_are_refused_by_name() {
        assert!(supported_architecture("NVIDIA H100 80GB HBM3", (9, 0)).is_ok());
        assert!(supported_architecture("Tesla T4", (7, 5)).is_ok());
        let e = supported_architecture("Tesla V100-SXM2-16GB", (7, 0)).unwrap_err();
        assert!(
            e.contains("V100") && e.contains("sm_70") && e.contains("sm_75"),
            "{e}"
        );
        assert!(supported_architecture("Tesla P100", (6, 0)).is_err());
    }

    #[test]
    fn the_probe_answers_without_panicking() {
        match probe() {
            Ok(info) => {
                assert!(info.arch().starts_with("sm_"));
                assert!(info.total_memory > 0);
            }
            Err(reason) => assert!(!reason.is_empty()),
        }
    }

    #[test]
    fn info_reads_well() {
        let info = CudaInfo {
            ordinal: 0,
            name: "NVIDIA H100 80GB HBM3".into(),
            compute_capability: (9, 0),
            total_memory: 80 << 30,
            free_memory: 79 << 30,
            driver_version: 13000,
        };
        assert_eq!(info.arch(), "sm_90");
        assert_eq!(
            info.to_string(),
            "cuda:0 NVIDIA H100 80GB HBM3 (sm_90, 80.0 GiB, 79.0 GiB free, driver CUDA 13.0)"
        );
    }
}
