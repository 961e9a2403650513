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
        // SAFETY: the range is inside the live mapping (checked); a raw copy tolerates
        // concurrent writers.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                buf.as_mut_ptr(),
                buf.len(),
            )
        };
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
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        };
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

impl Drop for RegionMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped only here.
        let _ = unsafe { munmap(self.ptr.cast(), self.len) };
    }
}
