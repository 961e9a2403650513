//! Mapping a memfd shared with other processes: a region's or a queue pair's ring, in the
//! client, and every memfd the daemon creates (`rdmad::memory::SharedMemory` is built on
//! [`RegionMapping`]). The memory is shared with the other side (and, through the daemon,
//! the RDMA device and the other processes a region is shared with), so access is by
//! copying in and out, bounds checked, never through references that could observe a
//! concurrent write. This module is the only place either crate maps or touches such memory
//! (the daemon's hugepage copies go through the kernel, without `unsafe`).

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};

/// A descriptor mapped `MAP_SHARED` into this process; owns the descriptor and the mapping.
#[derive(Debug)]
pub struct RegionMapping {
    ptr: NonNull<u8>,
    len: usize,
    writable: bool,
    fd: OwnedFd,
}

// SAFETY: the mapping is owned by this value and accessed only through raw copies and
// atomics; no method hands out a reference into it that could outlive a call.
unsafe impl Send for RegionMapping {}
// SAFETY: as for `Send`: concurrent calls only make atomic accesses to the mapping.
unsafe impl Sync for RegionMapping {}

impl RegionMapping {
    /// Maps `len` bytes of `fd`. `writable` asks for a writable shared mapping, which the
    /// kernel refuses (EACCES) for a read-only attachment's descriptor.
    pub fn map(fd: OwnedFd, len: usize, writable: bool) -> io::Result<RegionMapping> {
        let length = std::num::NonZeroUsize::new(len)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "empty region"))?;
        let mut prot = ProtFlags::PROT_READ;
        if writable {
            prot |= ProtFlags::PROT_WRITE;
        }
        // SAFETY: a new shared mapping of a file descriptor at an address the kernel picks;
        // it aliases no Rust object, and it is unmapped only in `Drop`.
        let ptr = unsafe { mmap(None, length, prot, MapFlags::MAP_SHARED, fd.as_fd(), 0) }?;
        Ok(RegionMapping {
            ptr: ptr.cast(),
            len,
            writable,
            fd,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// This process's address of the first byte: for the kernel and the device, which are
    /// told about the memory; valid while `self` lives.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The mapped descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Fails unless `[offset, offset + len)` lies inside the mapping.
    pub fn check_range(&self, offset: usize, len: usize) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "range {offset}+{len} lies outside the {}-byte region",
                    self.len
                ),
            )),
        }
    }

    fn check_writable(&self) -> io::Result<()> {
        if self.writable {
            Ok(())
        } else {
            Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "the region is mapped read-only",
            ))
        }
    }

    /// Copies bytes at `offset` out of the mapping.
    pub fn read(&self, offset: usize, buf: &mut [u8]) -> io::Result<()> {
        self.check_range(offset, buf.len())?;
        // SAFETY: the range lies inside the live mapping (checked above), which stays
        // mapped while `self` lives.
        unsafe { copy_from_shared(self.ptr.as_ptr().add(offset), buf) };
        Ok(())
    }

    /// Copies `data` into the mapping at `offset` (the mapping must be writable).
    pub fn write(&self, offset: usize, data: &[u8]) -> io::Result<()> {
        self.check_writable()?;
        self.check_range(offset, data.len())?;
        // SAFETY: as in `read`; the mapping is writable (checked above).
        unsafe { copy_to_shared(data, self.ptr.as_ptr().add(offset)) };
        Ok(())
    }

    /// Copies `len` bytes at `offset` of this mapping to `dst` (writable) at `dst_offset`,
    /// with no buffer between: the one copy a device makes. Other processes may write
    /// either side meanwhile; what lands is whatever the loads saw. Overlapping ranges of
    /// one mapping copy as if through a buffer (two mappings of one file are not told
    /// apart: there the bytes land as a forward copy leaves them).
    pub fn copy_to(
        &self,
        offset: usize,
        dst: &RegionMapping,
        dst_offset: usize,
        len: usize,
    ) -> io::Result<()> {
        dst.check_writable()?;
        self.check_range(offset, len)?;
        dst.check_range(dst_offset, len)?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: both ranges lie inside live mappings (checked above), which stay mapped
        // while `self` and `dst` live; `dst` is writable (checked above).
        let (src, to) = unsafe {
            (
                self.ptr.as_ptr().add(offset),
                dst.ptr.as_ptr().add(dst_offset),
            )
        };
        let (src_at, to_at) = (src as usize, to as usize);
        if src_at < to_at + len && to_at < src_at + len {
            let mut buf = vec![0u8; len];
            // SAFETY: as above.
            unsafe {
                copy_from_shared(src, &mut buf);
                copy_to_shared(&buf, to);
            }
            return Ok(());
        }
        // SAFETY: as above; the ranges do not overlap.
        unsafe { copy_between_shared(src, to, len) };
        Ok(())
    }

    /// An acquire load of the `u32` at `offset` (4-byte aligned), for ring indices the
    /// other side publishes.
    pub fn load_u32(&self, offset: usize) -> io::Result<u32> {
        Ok(self.atomic_u32(offset)?.load(Ordering::Acquire))
    }

    /// A release store of a `u32` at `offset` (4-byte aligned; the mapping must be
    /// writable), publishing what was written before it.
    pub fn store_u32(&self, offset: usize, value: u32) -> io::Result<()> {
        self.check_writable()?;
        self.atomic_u32(offset)?.store(value, Ordering::Release);
        Ok(())
    }

    fn atomic_u32(&self, offset: usize) -> io::Result<&AtomicU32> {
        self.check_range(offset, 4)?;
        if offset % 4 != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("offset {offset} is not 4-byte aligned"),
            ));
        }
        // SAFETY: the 4 bytes lie inside the live mapping (checked) and are 4-byte aligned
        // (the mapping is page aligned); other processes access them only atomically by
        // the ring protocol, and the reference lives no longer than `self`. A store through
        // it is made only on a writable mapping (`store_u32` checks).
        Ok(unsafe { AtomicU32::from_ptr(self.ptr.as_ptr().add(offset).cast()) })
    }
}

/// The unit of the shared-memory copies: a pointer-sized word, the widest relaxed atomic
/// load Rust allows on read-only memory (a read-only attachment is mapped `PROT_READ`).
const WORD: usize = std::mem::size_of::<usize>();

/// Copies `dst.len()` bytes of shared memory at `src` into `dst`. Another process may write
/// the source at any time, so every byte is read with a relaxed atomic load (aligned words
/// where it can), never with a plain copy the compiler may assume is race-free: the bytes
/// read are then whatever was there, never undefined behaviour.
///
/// # Safety
/// `src..src + dst.len()` must lie inside one live mapping for the whole call. The mapping
/// may be read-only: only relaxed loads of at most a word are made, which Rust allows on
/// read-only memory.
unsafe fn copy_from_shared(src: *const u8, dst: &mut [u8]) {
    use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering::Relaxed};
    let len = dst.len();
    let head = src.align_offset(WORD).min(len);
    let words = (len - head) / WORD;
    for (i, byte) in dst[..head].iter_mut().enumerate() {
        // SAFETY: inside the mapping (the caller's promise); any address is aligned for u8.
        *byte = unsafe { AtomicU8::from_ptr(src.add(i).cast_mut()) }.load(Relaxed);
    }
    for w in 0..words {
        let at = head + WORD * w;
        // SAFETY: inside the mapping, and word aligned (`head` aligned the source).
        let word = unsafe { AtomicUsize::from_ptr(src.add(at).cast_mut().cast()) }.load(Relaxed);
        dst[at..at + WORD].copy_from_slice(&word.to_ne_bytes());
    }
    for (i, byte) in dst.iter_mut().enumerate().skip(head + WORD * words) {
        // SAFETY: as for the head bytes.
        *byte = unsafe { AtomicU8::from_ptr(src.add(i).cast_mut()) }.load(Relaxed);
    }
}

/// Copies `src` into shared memory at `dst`, with atomic stores (see
/// [`copy_from_shared`]).
///
/// # Safety
/// `dst..dst + src.len()` must lie inside one live writable mapping for the whole call.
unsafe fn copy_to_shared(src: &[u8], dst: *mut u8) {
    use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering::Relaxed};
    let len = src.len();
    let head = dst.align_offset(WORD).min(len);
    let words = (len - head) / WORD;
    for (i, &byte) in src[..head].iter().enumerate() {
        // SAFETY: inside the writable mapping (the caller's promise).
        unsafe { AtomicU8::from_ptr(dst.add(i)) }.store(byte, Relaxed);
    }
    for w in 0..words {
        let at = head + WORD * w;
        let word = usize::from_ne_bytes(src[at..at + WORD].try_into().expect("a word"));
        // SAFETY: inside the writable mapping, and word aligned (`head` aligned it).
        unsafe { AtomicUsize::from_ptr(dst.add(at).cast()) }.store(word, Relaxed);
    }
    for (i, &byte) in src.iter().enumerate().skip(head + WORD * words) {
        // SAFETY: as for the head bytes.
        unsafe { AtomicU8::from_ptr(dst.add(i)) }.store(byte, Relaxed);
    }
}

/// The longest copy between mappings made word by word rather than with the CPU's string
/// copy.
const SMALL_COPY: usize = 256;

/// Copies `len` bytes from shared memory at `src` to shared memory at `dst`, as one pass:
/// on x86-64 with `rep movsb` (the CPU's string copy, as fast as `memcpy` for large copies
/// on CPUs with ERMS), which the compiler cannot see into, so a concurrent write by another
/// process is a race of the hardware (each byte lands as some store left it), never
/// undefined behaviour in this program; elsewhere word by word with relaxed atomics.
///
/// # Safety
/// `src..src + len` must lie inside one live mapping and `dst..dst + len` inside one live
/// writable mapping for the whole call, and the two ranges must not overlap.
unsafe fn copy_between_shared(src: *const u8, dst: *mut u8, len: usize) {
    if len <= SMALL_COPY {
        // `rep movsb` starts slowly (a 64-byte copy at a fifth of `memcpy`'s speed): small
        // copies go word by word through a buffer on the stack.
        let mut buf = [0u8; SMALL_COPY];
        // SAFETY: inside the two mappings (the caller's promise).
        unsafe {
            copy_from_shared(src, &mut buf[..len]);
            copy_to_shared(&buf[..len], dst);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let skew = (dst as usize).wrapping_sub(src as usize) % PAGE;
        if skew == 0 || skew >= ALIASED {
            // SAFETY: the caller's promise.
            unsafe { string_copy(src, dst, len) };
            return;
        }
        // The destination is just past the source modulo a page: `rep movsb` takes that
        // for an overlap on some CPUs and crawls (measured on an AMD EPYC: a 64 KiB copy at
        // 2-3 GB/s with the destination 1-31 bytes ahead, 45 GB/s otherwise). The bytes go
        // through a buffer on the stack placed half a page from both, in two string copies.
        let mut buf = std::mem::MaybeUninit::<[u8; 2 * PAGE]>::uninit();
        let base = buf.as_mut_ptr().cast::<u8>();
        let at = (src as usize)
            .wrapping_add(PAGE / 2)
            .wrapping_sub(base as usize)
            % PAGE;
        // SAFETY: `at < PAGE`, so `at + PAGE` bytes fit in the buffer.
        let bounce = unsafe { base.add(at) };
        let mut done = 0;
        while done < len {
            let n = (len - done).min(PAGE);
            // SAFETY: the caller's promise for `src` and `dst`; `bounce..bounce + n` lies
            // in the buffer, which overlaps neither mapping, and is written before it is
            // read.
            unsafe {
                string_copy(src.add(done), bounce, n);
                string_copy(bounce, dst.add(done), n);
            }
            done += n;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let mut buf = [0u8; PAGE];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(buf.len());
            // SAFETY: inside the two mappings (the caller's promise).
            unsafe {
                copy_from_shared(src.add(done), &mut buf[..n]);
                copy_to_shared(&buf[..n], dst.add(done));
            }
            done += n;
        }
    }
}

/// The page size the CPU's aliasing of addresses goes by.
const PAGE: usize = 4096;

/// How far past the source (modulo [`PAGE`]) a destination is still taken for an overlap by
/// `rep movsb` on some CPUs (31 bytes measured; a cache line to be safe).
#[cfg(target_arch = "x86_64")]
const ALIASED: usize = 64;

/// `rep movsb`: `len` bytes from `src` to `dst`.
///
/// # Safety
/// `src..src + len` must be readable and `dst..dst + len` writable for the whole call, and
/// the two must not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn string_copy(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: reads `len` bytes at `src` and writes `len` bytes at `dst` (the caller's
    // promise); the direction flag is clear on entry (the ABI), and `rep movsb` touches no
    // stack and no flags.
    unsafe {
        std::arch::asm!(
            "rep movsb",
            inout("rcx") len => _,
            inout("rsi") src => _,
            inout("rdi") dst => _,
            options(nostack, preserves_flags)
        );
    }
}

impl Drop for RegionMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped only here.
        let _ = unsafe { munmap(self.ptr.cast(), self.len) };
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// An anonymous memfd of `len` bytes.
    pub(crate) fn memfd(len: usize) -> OwnedFd {
        let fd = nix::sys::memfd::memfd_create(
            c"mapping-test",
            nix::sys::memfd::MemFdCreateFlag::empty(),
        )
        .unwrap();
        nix::unistd::ftruncate(&fd, len as i64).unwrap();
        fd
    }

    #[test]
    fn accesses_are_bounds_checked_and_writes_need_a_writable_mapping() {
        let rw = RegionMapping::map(memfd(4096), 4096, true).unwrap();
        rw.write(4090, b"abcdef").unwrap();
        assert!(rw.write(4091, b"abcdef").is_err());
        assert!(rw.read(usize::MAX, &mut [0u8; 2]).is_err());
        rw.store_u32(64, 7).unwrap();
        assert!(rw.load_u32(66).is_err(), "unaligned");
        assert!(rw.store_u32(4094, 1).is_err(), "out of range");

        let ro = RegionMapping::map(rw.fd().try_clone_to_owned().unwrap(), 4096, false).unwrap();
        assert_eq!(ro.load_u32(64).unwrap(), 7, "one file, two mappings");
        let mut buf = [0u8; 6];
        ro.read(4090, &mut buf).unwrap();
        assert_eq!(&buf, b"abcdef");
        let denied = ro.write(0, b"x").unwrap_err();
        assert_eq!(denied.kind(), io::ErrorKind::PermissionDenied);
        let denied = ro.store_u32(64, 1).unwrap_err();
        assert_eq!(denied.kind(), io::ErrorKind::PermissionDenied);
        assert!(RegionMapping::map(memfd(4096), 0, true).is_err(), "empty");
    }

    #[test]
    fn shared_copies_handle_every_alignment_and_length() {
        let source: Vec<u8> = (0..64u8).collect();
        for start in 0..9 {
            for len in 0..(64 - start) {
                let mut out = vec![0xaa; len];
                // SAFETY: `source` is live and the range lies inside it.
                unsafe { copy_from_shared(source.as_ptr().add(start), &mut out) };
                assert_eq!(out, source[start..start + len], "read {start}+{len}");
                let mut target = vec![0u8; 64];
                // SAFETY: `target` is live and the range lies inside it.
                unsafe { copy_to_shared(&source[..len], target.as_mut_ptr().add(start)) };
                assert_eq!(
                    &target[start..start + len],
                    &source[..len],
                    "write {start}+{len}"
                );
                assert!(target[..start].iter().all(|&b| b == 0));
                assert!(target[start + len..].iter().all(|&b| b == 0));
            }
        }
    }

    /// A copy between mappings moves exactly the bytes asked, at any alignment, length and
    /// distance between source and destination;
    /// overlapping ranges of one mapping land as if copied through a buffer; a read-only
    /// target or a range outside either mapping is refused and nothing moves.
    #[test]
    fn copies_between_mappings_move_exactly_their_range() {
        let src = RegionMapping::map(memfd(8192), 8192, true).unwrap();
        let pattern: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 3) as u8).collect();
        src.write(0, &pattern).unwrap();
        for (from, to, len) in [
            (0, 0, 8192),
            (1, 7, 100),
            (3, 1000, SMALL_COPY),
            (3, 1000, SMALL_COPY + 1),
            (4093, 3, 4099),
            // The destination just past the source modulo a page: through the bounce
            // buffer, a page at a time, the last one partial.
            (0, 16, 8000),
            (100, 163, 5000),
            (7, 8, SMALL_COPY + 1),
            (0, 1, PAGE),
            (100, 164, 5000),
            (9, 8191, 1),
            (5, 5, 0),
        ] {
            let dst = RegionMapping::map(memfd(8192), 8192, true).unwrap();
            src.copy_to(from, &dst, to, len).unwrap();
            let mut out = vec![0u8; 8192];
            dst.read(0, &mut out).unwrap();
            assert_eq!(
                &out[to..to + len],
                &pattern[from..from + len],
                "{from}->{to}+{len}"
            );
            assert!(out[..to].iter().chain(&out[to + len..]).all(|&b| b == 0));
        }
        for (from, to) in [(0, 100), (100, 0)] {
            let one = RegionMapping::map(memfd(8192), 8192, true).unwrap();
            one.write(0, &pattern).unwrap();
            one.copy_to(from, &one, to, 4000).unwrap();
            let mut out = vec![0u8; 4000];
            one.read(to, &mut out).unwrap();
            assert_eq!(out, pattern[from..from + 4000], "overlap {from}->{to}");
        }
        let dst = RegionMapping::map(memfd(8192), 8192, true).unwrap();
        assert!(src.copy_to(8000, &dst, 0, 193).is_err());
        assert!(src.copy_to(0, &dst, 8000, 193).is_err());
        assert!(src.copy_to(usize::MAX, &dst, 0, 2).is_err());
        let ro = RegionMapping::map(dst.fd().try_clone_to_owned().unwrap(), 8192, false).unwrap();
        let denied = src.copy_to(0, &ro, 0, 8).unwrap_err();
        assert_eq!(denied.kind(), io::ErrorKind::PermissionDenied);
        let mut out = vec![0u8; 8192];
        dst.read(0, &mut out).unwrap();
        assert!(out.iter().all(|&b| b == 0), "refused copies move nothing");
    }
}
