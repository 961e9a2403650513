//! Mapping a region's memfd into the client. The memory is shared with the daemon (and,
//! through it, the RDMA device and other processes the region is shared with), so access is
//! by copying in and out, never through references that could observe a concurrent write.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;

use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};

/// A region mapped `MAP_SHARED` into this process.
#[derive(Debug)]
pub struct RegionMapping {
    ptr: NonNull<u8>,
    len: usize,
    writable: bool,
    _fd: OwnedFd,
}

// SAFETY: the mapping is owned by this value and accessed only through raw copies.
unsafe impl Send for RegionMapping {}
// SAFETY: as for `Send`; no method hands out references into the mapping.
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
            _fd: fd,
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

    fn check(&self, offset: usize, len: usize) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{offset}+{len} lies outside the {}-byte region", self.len),
            )),
        }
    }

    /// Copies bytes at `offset` out of the region.
    pub fn read(&self, offset: usize, buf: &mut [u8]) -> io::Result<()> {
        self.check(offset, buf.len())?;
        // SAFETY: the range is inside the live mapping (checked).
        unsafe { copy_from_shared(self.ptr.as_ptr().add(offset), buf) };
        Ok(())
    }

    /// Copies `data` into the region at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> io::Result<()> {
        if !self.writable {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "the region is mapped read-only",
            ));
        }
        self.check(offset, data.len())?;
        // SAFETY: as in `read`; the mapping is writable.
        unsafe { copy_to_shared(data, self.ptr.as_ptr().add(offset)) };
        Ok(())
    }
}

impl RegionMapping {
    fn atomic_u32(&self, offset: usize) -> io::Result<&std::sync::atomic::AtomicU32> {
        self.check(offset, 4)?;
        if offset % 4 != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "unaligned ring word",
            ));
        }
        // SAFETY: inside the live mapping (checked), 4-byte aligned (the mapping is page
        // aligned), accessed by the other side only atomically per the ring protocol; the
        // reference does not outlive `self`.
        Ok(unsafe { std::sync::atomic::AtomicU32::from_ptr(self.ptr.as_ptr().add(offset).cast()) })
    }

    /// Acquire load of a ring word.
    pub fn load_u32(&self, offset: usize) -> io::Result<u32> {
        Ok(self
            .atomic_u32(offset)?
            .load(std::sync::atomic::Ordering::Acquire))
    }

    /// Release store of a ring word (the mapping must be writable).
    pub fn store_u32(&self, offset: usize, value: u32) -> io::Result<()> {
        if !self.writable {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "read-only mapping",
            ));
        }
        self.atomic_u32(offset)?
            .store(value, std::sync::atomic::Ordering::Release);
        Ok(())
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
pub unsafe fn copy_from_shared(src: *const u8, dst: &mut [u8]) {
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
pub unsafe fn copy_to_shared(src: &[u8], dst: *mut u8) {
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
