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

impl Drop for RegionMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped only here.
        let _ = unsafe { munmap(self.ptr.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd(len: usize) -> OwnedFd {
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
}
