//! Files mapped into memory: pages a reader has finished with handed back.

use memmap2::Mmap;

/// Hands the pages of `map[offset .. offset + len]` back to the kernel, so that pages a
/// reader has finished with do not stay in the process's resident memory; a later read
/// faults them in again from the page cache.
pub(crate) fn release(map: &Mmap, offset: usize, len: usize) {
    #[cfg(unix)]
    {
        const PAGE: usize = 4096;
        let first = offset / PAGE * PAGE;
        let end = (offset + len).min(map.len());
        if end > first {
            // SAFETY: the mapping is a shared, read-only mapping of a file (memmap2's
            // `Mmap::map`), so MADV_DONTNEED drops this process's page-table entries
            // without changing what the range reads as: a later access refaults the same
            // file contents. No reference into the range is used while the call runs in
            // this thread, and a concurrent reader elsewhere reads the same bytes either
            // way.
            let _ = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, first, end - first)
            };
        }
    }
    #[cfg(not(unix))]
    let _ = (map, offset, len);
}
