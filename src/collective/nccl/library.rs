//! NCCL, opened by trainkit itself as NVRTC and cuBLASLt are
//! ([`crate::device::cuda::libraries`]): `libnccl.so.2` (the only name NVIDIA's pip wheel
//! ships, which cudarc's loader does not try), then `libnccl.so`, or the file
//! `$TRAINKIT_NCCL` names. The functions a data-parallel job calls, through one table,
//! and the library's version, checked against the oldest trainkit runs on.

use crate::device::cuda::libraries::{Library, Search};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::Path;
use std::sync::OnceLock;

/// The environment variable naming the NCCL library file to open, instead of the loader's
/// search for `libnccl.so.2`.
pub const NCCL_ENV: &str = "TRAINKIT_NCCL";

/// The oldest NCCL trainkit runs on, as NCCL codes versions (`major * 10000 + minor * 100
/// + patch`): 2.13 brought `ncclGetLastError`, whose text every error carries.
pub const MIN_VERSION: i32 = 21300;

/// An NCCL communicator (`ncclComm_t`).
pub type Comm = *mut c_void;

/// What ranks exchange to form one communicator (`ncclUniqueId`): made by one rank,
/// handed to the others (over MPI, or taken from `NCCL_COMM_ID` by every rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct UniqueId {
    /// NCCL's opaque bytes.
    pub bytes: [u8; 128],
}

/// NCCL's element types (`ncclDataType_t`) trainkit sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum DataType {
    /// `ncclUint8`: bytes.
    U8 = 1,
    /// `ncclFloat16`.
    F16 = 6,
    /// `ncclFloat32`.
    F32 = 7,
    /// `ncclFloat64`.
    F64 = 8,
    /// `ncclBfloat16`.
    Bf16 = 9,
}

/// `ncclSum`: the only reduction trainkit asks for (sums, scaled once locally).
const SUM: c_int = 0;

/// `ncclInProgress`: a non-blocking call still running.
pub const IN_PROGRESS: i32 = 7;

/// A failed call: the function, NCCL's result code and its texts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NcclError {
    /// The function that failed.
    pub call: &'static str,
    /// Its `ncclResult_t`.
    pub code: i32,
    /// `ncclGetErrorString` of the code, and `ncclGetLastError`'s detail where it has one.
    pub text: String,
}

impl std::fmt::Display for NcclError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} failed ({}): {}", self.call, self.code, self.text)
    }
}

type R = c_int;

/// NCCL's functions, as trainkit calls them.
#[derive(Debug)]
pub struct NcclLibrary {
    lib: Library,
    version: i32,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> R,
    comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> R,
    comm_destroy: unsafe extern "C" fn(Comm) -> R,
    comm_abort: unsafe extern "C" fn(Comm) -> R,
    comm_async_error: unsafe extern "C" fn(Comm, *mut R) -> R,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        *mut c_void,
    ) -> R,
    reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        c_int,
        Comm,
        *mut c_void,
    ) -> R,
    reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        *mut c_void,
    ) -> R,
    all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, *mut c_void) -> R,
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        *mut c_void,
    ) -> R,
    group_start: unsafe extern "C" fn() -> R,
    group_end: unsafe extern "C" fn() -> R,
    error_string: unsafe extern "C" fn(R) -> *const c_char,
    last_error: unsafe extern "C" fn(Comm) -> *const c_char,
}

/// The version code `v` as NCCL prints it: `2.21.5`.
pub fn version_text(v: i32) -> String {
    format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
}

impl NcclLibrary {
    /// Opens NCCL: the file `$TRAINKIT_NCCL` names, else `libnccl.so.2` then
    /// `libnccl.so` through the loader's search (`LD_LIBRARY_PATH` first). Fails naming
    /// every file tried and the fix, or when the library is older than [`MIN_VERSION`].
    pub fn open_default() -> Result<NcclLibrary, String> {
        match std::env::var_os(NCCL_ENV) {
            Some(file) => {
                Self::open_file(Path::new(&file)).map_err(|e| format!("${NCCL_ENV}: {e}"))
            }
            None => Self::open(Search::Loader),
        }
    }

    /// Opens `libnccl.so.2` (then `libnccl.so`) where `search` says.
    pub fn open(search: Search<'_>) -> Result<NcclLibrary, String> {
        let names = ["libnccl.so.2".to_string(), "libnccl.so".to_string()];
        Self::from(Library::open_names(&names, search, "ncclGetVersion"))
    }

    /// Opens the library file at `file`.
    pub fn open_file(file: &Path) -> Result<NcclLibrary, String> {
        let names = [file.to_string_lossy().into_owned()];
        Self::from(Library::open_names(
            &names,
            Search::Loader,
            "ncclGetVersion",
        ))
    }

    fn from(opened: Result<Library, String>) -> Result<NcclLibrary, String> {
        let lib = opened.map_err(|tried| {
            format!(
                "NCCL was not found ({tried}): install it (the `nvidia-nccl-cu13` pip wheel, \
                 which PyTorch brings, or a system package) and put its lib directory on \
                 LD_LIBRARY_PATH, or name the file in ${NCCL_ENV}"
            )
        })?;
        // SAFETY: each type is the documented signature of the NCCL function named (nccl.h).
        let table = unsafe {
            let get_version: unsafe extern "C" fn(*mut c_int) -> R =
                lib.function("ncclGetVersion")?;
            let mut version = 0;
            if get_version(&mut version) != 0 {
                return Err(format!("{}: ncclGetVersion failed", lib.path().display()));
            }
            NcclLibrary {
                version,
                get_unique_id: lib.function("ncclGetUniqueId")?,
                comm_init_rank: lib.function("ncclCommInitRank")?,
                comm_destroy: lib.function("ncclCommDestroy")?,
                comm_abort: lib.function("ncclCommAbort")?,
                comm_async_error: lib.function("ncclCommGetAsyncError")?,
                all_reduce: lib.function("ncclAllReduce")?,
                reduce: lib.function("ncclReduce")?,
                reduce_scatter: lib.function("ncclReduceScatter")?,
                all_gather: lib.function("ncclAllGather")?,
                broadcast: lib.function("ncclBroadcast")?,
                group_start: lib.function("ncclGroupStart")?,
                group_end: lib.function("ncclGroupEnd")?,
                error_string: lib.function("ncclGetErrorString")?,
                last_error: lib.function("ncclGetLastError")?,
                lib,
            }
        };
        if table.version < MIN_VERSION {
            return Err(format!(
                "{} is NCCL {}, older than the {} trainkit needs: install a newer one \
                 (`pip install nvidia-nccl-cu13`)",
                table.lib.path().display(),
                version_text(table.version),
                version_text(MIN_VERSION)
            ));
        }
        Ok(table)
    }

    /// The process's NCCL ([`NcclLibrary::open_default`]), opened on first use.
    pub fn get() -> Result<&'static NcclLibrary, String> {
        static NCCL: OnceLock<Result<NcclLibrary, String>> = OnceLock::new();
        NCCL.get_or_init(NcclLibrary::open_default)
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The file NCCL was loaded from.
    pub fn path(&self) -> &Path {
        self.lib.path()
    }

    /// Its version code (`22103` for 2.21.3).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// `code`'s meaning, and the library's last error message for `comm` (null: the
    /// last of any) where it says more.
    fn error(&self, call: &'static str, code: R, comm: Comm) -> NcclError {
        // SAFETY: both return static or library-owned NUL-terminated strings (or null).
        let text = |p: *const c_char| {
            if p.is_null() {
                String::new()
            } else {
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        let meaning = text(unsafe { (self.error_string)(code) });
        let detail = text(unsafe { (self.last_error)(comm) });
        NcclError {
            call,
            code,
            text: if detail.is_empty() || detail == meaning {
                meaning
            } else {
                format!("{meaning}: {detail}")
            },
        }
    }

    fn check(&self, call: &'static str, code: R, comm: Comm) -> Result<(), NcclError> {
        if code == 0 {
            Ok(())
        } else {
            Err(self.error(call, code, comm))
        }
    }

    /// A new unique id (made by one rank; with `NCCL_COMM_ID` set, every rank makes the
    /// same one from that address).
    pub fn unique_id(&self) -> Result<UniqueId, NcclError> {
        let mut id = UniqueId { bytes: [0; 128] };
        // SAFETY: `id` is valid for writes of an `ncclUniqueId`.
        let code = unsafe { (self.get_unique_id)(&mut id) };
        self.check("ncclGetUniqueId", code, std::ptr::null_mut())?;
        Ok(id)
    }

    /// Joins communicator `id` as `rank` of `world`, on the CUDA device current on this
    /// thread; returns when every rank has joined.
    pub fn init_rank(&self, world: usize, id: UniqueId, rank: usize) -> Result<Comm, NcclError> {
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is valid for writes; the id is passed by value as NCCL takes it.
        let code = unsafe { (self.comm_init_rank)(&mut comm, world as c_int, id, rank as c_int) };
        self.check("ncclCommInitRank", code, std::ptr::null_mut())?;
        Ok(comm)
    }

    /// Destroys `comm` once its queued work is done.
    ///
    /// # Safety
    /// `comm` must come from [`NcclLibrary::init_rank`] and not be used afterwards.
    pub unsafe fn destroy(&self, comm: Comm) -> Result<(), NcclError> {
        // SAFETY: the caller's contract.
        let code = unsafe { (self.comm_destroy)(comm) };
        self.check("ncclCommDestroy", code, std::ptr::null_mut())
    }

    /// Aborts `comm`: its queued work is cancelled and waiting ranks are released.
    ///
    /// # Safety
    /// `comm` must come from [`NcclLibrary::init_rank`] and not be used afterwards.
    pub unsafe fn abort(&self, comm: Comm) -> Result<(), NcclError> {
        // SAFETY: the caller's contract.
        let code = unsafe { (self.comm_abort)(comm) };
        self.check("ncclCommAbort", code, std::ptr::null_mut())
    }

    /// The error a communicator met while its work ran (a peer gone, a network failure),
    /// if any.
    ///
    /// # Safety
    /// `comm` must be a live communicator.
    pub unsafe fn async_error(&self, comm: Comm) -> Result<(), NcclError> {
        let mut state = 0;
        // SAFETY: the caller's contract; `state` is valid for writes.
        let code = unsafe { (self.comm_async_error)(comm, &mut state) };
        self.check("ncclCommGetAsyncError", code, comm)?;
        if state == 0 || state == IN_PROGRESS {
            return Ok(());
        }
        Err(self.error("a collective of this communicator", state, comm))
    }

    /// Queues the sum over ranks of `count` values at `send` into `recv` (which may be
    /// `send`) on `stream`.
    ///
    /// # Safety
    /// Both pointers address `count` values of `ty` in device memory of the
    /// communicator's device; `stream` is a stream of that device; `comm` is live.
    pub unsafe fn all_reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        ty: DataType,
        comm: Comm,
        stream: *mut c_void,
    ) -> Result<(), NcclError> {
        // SAFETY: the caller's contract.
        let code = unsafe {
            (self.all_reduce)(send as _, recv as _, count, ty as c_int, SUM, comm, stream)
        };
        self.check("ncclAllReduce", code, comm)
    }

    /// Queues the sum over ranks of `count` values at `send` into `recv` on rank `root`
    /// alone (the other ranks' `recv` is left as it is).
    ///
    /// # Safety
    /// As [`NcclLibrary::all_reduce`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        ty: DataType,
        root: usize,
        comm: Comm,
        stream: *mut c_void,
    ) -> Result<(), NcclError> {
        // SAFETY: the caller's contract.
        let code = unsafe {
            (self.reduce)(
                send as _,
                recv as _,
                count,
                ty as c_int,
                SUM,
                root as c_int,
                comm,
                stream,
            )
        };
        self.check("ncclReduce", code, comm)
    }

    /// Queues the sum over ranks of `world × count` values at `send`, rank `r` keeping
    /// block `r` (`count` values) at `recv`.
    ///
    /// # Safety
    /// As [`NcclLibrary::all_reduce`], with `send` holding `world × count` values.
    pub unsafe fn reduce_scatter(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        ty: DataType,
        comm: Comm,
        stream: *mut c_void,
    ) -> Result<(), NcclError> {
        // SAFETY: the caller's contract.
        let code = unsafe {
            (self.reduce_scatter)(send as _, recv as _, count, ty as c_int, SUM, comm, stream)
        };
        self.check("ncclReduceScatter", code, comm)
    }

    /// Queues every rank's `count` values at `send`, in rank order, into `recv`.
    ///
    /// # Safety
    /// As [`NcclLibrary::all_reduce`], with `recv` holding `world × count` values.
    pub unsafe fn all_gather(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        ty: DataType,
        comm: Comm,
        stream: *mut c_void,
    ) -> Result<(), NcclError> {
        // SAFETY: the caller's contract.
        let code =
            unsafe { (self.all_gather)(send as _, recv as _, count, ty as c_int, comm, stream) };
        self.check("ncclAllGather", code, comm)
    }

    /// Queues rank `root`'s `count` values at `send` into `recv` on every rank.
    ///
    /// # Safety
    /// As [`NcclLibrary::all_reduce`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn broadcast(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        ty: DataType,
        root: usize,
        comm: Comm,
        stream: *mut c_void,
    ) -> Result<(), NcclError> {
        // SAFETY: the caller's contract.
        let code = unsafe {
            (self.broadcast)(
                send as _,
                recv as _,
                count,
                ty as c_int,
                root as c_int,
                comm,
                stream,
            )
        };
        self.check("ncclBroadcast", code, comm)
    }

    /// Opens a group: the collectives queued until [`NcclLibrary::group_end`] are
    /// launched together.
    pub fn group_start(&self) -> Result<(), NcclError> {
        // SAFETY: no arguments.
        let code = unsafe { (self.group_start)() };
        self.check("ncclGroupStart", code, std::ptr::null_mut())
    }

    /// Closes a group and launches its collectives.
    pub fn group_end(&self) -> Result<(), NcclError> {
        // SAFETY: no arguments.
        let code = unsafe { (self.group_end)() };
        self.check("ncclGroupEnd", code, std::ptr::null_mut())
    }
}
