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

impl Drop for RegionMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped only here.
        let _ = unsafe { munmap(self.ptr.cast(), self.len) };
    }
}
