//! Shared memory that clients map: one memfd per region, sized once and sealed against
//! shrinking and growing, mapped shared into the daemon through the client crate's
//! [`RegionMapping`] (the one type either side maps shared memory with; its module holds
//! the `unsafe`, this one needs none).
//!
//! Clients hold the memfd and may do anything to it that its seals allow, at any moment:
//! write it, punch holes in it (`fallocate(PUNCH_HOLE)`), keep it after the daemon let go.
//! So the daemon
//! - copies in and out with atomic accesses ([`RegionMapping::read`]/[`RegionMapping::write`]),
//!   and from one mapping to another with the CPU's string copy, which the compiler cannot
//!   see into ([`RegionMapping::copy_to`]), never with plain copies of memory that races;
//! - never faults a hugepage-backed file through its own mapping: a punched hugepage is
//!   refaulted from the system's free hugepages, and when there is none left the fault is a
//!   `SIGBUS` that would kill the daemon. Hugepage memory is copied by the kernel
//!   (`process_vm_readv`/`process_vm_writev` on the daemon itself), which answers `EFAULT`
//!   instead; the copy fails, not the daemon. (A shmem file refaults a zero page: its size
//!   is sealed, so no access inside it can `SIGBUS`.)
//! - punches the whole file when it lets go ([`Drop`]), so pages a client kept alive by
//!   holding the descriptor or a mapping are returned at once; whatever that client later
//!   writes through a stale mapping is its own memory, charged to it, and reads as zero.

use std::ffi::CStr;
use std::io;
use std::os::fd::BorrowedFd;

use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
use rdmad_client::RegionMapping;

/// A memfd of fixed size mapped read-write and shared into the daemon.
#[derive(Debug)]
pub struct SharedMemory {
    /// The memfd and its mapping (dropped after [`Drop::drop`] punched the file).
    map: RegionMapping,
    /// Backed by hugetlbfs: copied by the kernel, never faulted by the daemon's own loads.
    hugepages: bool,
}

impl SharedMemory {
    /// Creates a zero-filled memfd of `len` bytes named `name` (visible in
    /// `/proc/PID/fd`), seals its size and maps it.
    pub fn create(name: &CStr, len: usize) -> io::Result<SharedMemory> {
        SharedMemory::create_with(name, len, false)
    }

    /// Like [`SharedMemory::create`], backed by 2 MiB hugepages when `hugepages` is set
    /// (`len` must then be a multiple of 2 MiB).
    ///
    /// The file is made mode 0600: a process given a read-only descriptor cannot reopen
    /// it read-write through `/proc/self/fd` unless it runs as the daemon's user. The size
    /// is sealed, and so are the seals, so nobody can shrink it under a mapping or seal it
    /// against the daemon's own writes.
    pub fn create_with(name: &CStr, len: usize, hugepages: bool) -> io::Result<SharedMemory> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "shared memory must be at least one byte long",
            ));
        }
        let mut flags = MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING;
        if hugepages {
            flags |= MemFdCreateFlag::MFD_HUGETLB;
        }
        let fd = memfd_create(name, flags)?;
        nix::sys::stat::fchmod(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )?;
        let size = libc::off_t::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "size too large"))?;
        nix::unistd::ftruncate(&fd, size)?;
        fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            FcntlArg::F_ADD_SEALS(
                SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL,
            ),
        )?;
        Ok(SharedMemory {
            map: RegionMapping::map(fd, len, true)?,
            hugepages,
        })
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The daemon's address of the first byte (what the device is told).
    pub fn addr(&self) -> u64 {
        self.map.as_ptr() as u64
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }

    /// The memfd, to duplicate and pass to a client.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.map.fd()
    }

    /// Whether the memory is backed by hugepages.
    pub fn is_hugepages(&self) -> bool {
        self.hugepages
    }

    /// `[offset, offset + len)` of the mapping as the kernel's copies name it.
    fn kernel_range(&self, offset: usize, len: usize) -> [nix::sys::uio::RemoteIoVec; 1] {
        [nix::sys::uio::RemoteIoVec {
            base: self.addr() as usize + offset,
            len,
        }]
    }

    /// Copies `buf.len()` bytes at `offset` out of the mapping. Fails (`EFAULT`) where a
    /// client punched a hugepage the system cannot give back.
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> io::Result<()> {
        if !self.hugepages {
            return self.map.read(offset, buf);
        }
        self.check_range(offset, buf.len())?;
        if buf.is_empty() {
            return Ok(());
        }
        let len = buf.len();
        let done = nix::sys::uio::process_vm_readv(
            nix::unistd::Pid::this(),
            &mut [io::IoSliceMut::new(buf)],
            &self.kernel_range(offset, len),
        )?;
        short_copy(done, len)
    }

    /// Copies `data` into the mapping at `offset` (fails like [`SharedMemory::read_at`]).
    pub fn write_at(&self, offset: usize, data: &[u8]) -> io::Result<()> {
        if !self.hugepages {
            return self.map.write(offset, data);
        }
        self.check_range(offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        let done = nix::sys::uio::process_vm_writev(
            nix::unistd::Pid::this(),
            &[io::IoSlice::new(data)],
            &self.kernel_range(offset, data.len()),
        )?;
        short_copy(done, data.len())
    }

    /// Copies `len` bytes at `offset` to `dst` at `dst_offset` in one pass, with no buffer
    /// between (a device's copy). Where either side is hugepage memory the bytes go
    /// through a buffer, each side copied by the kernel as in [`SharedMemory::read_at`],
    /// so a punched hugepage fails the copy (`EFAULT`, with the side it failed on), not the
    /// daemon; what moved before stays.
    pub fn copy_to(
        &self,
        offset: usize,
        dst: &SharedMemory,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), CopyError> {
        self.check_range(offset, len).map_err(CopyError::Source)?;
        dst.check_range(dst_offset, len)
            .map_err(CopyError::Target)?;
        if !self.hugepages && !dst.hugepages {
            return self
                .map
                .copy_to(offset, &dst.map, dst_offset, len)
                .map_err(CopyError::Target);
        }
        let mut buf = vec![0u8; len.min(HUGEPAGE_BOUNCE)];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(buf.len());
            self.read_at(offset + done, &mut buf[..n])
                .map_err(CopyError::Source)?;
            dst.write_at(dst_offset + done, &buf[..n])
                .map_err(CopyError::Target)?;
            done += n;
        }
        Ok(())
    }

    /// An acquire load of the `u32` at `offset` (4-byte aligned), for ring indices another
    /// process publishes.
    pub fn load_u32(&self, offset: usize) -> io::Result<u32> {
        self.map.load_u32(offset)
    }

    /// A release store of a `u32` at `offset` (4-byte aligned), publishing what was
    /// written before it.
    pub fn store_u32(&self, offset: usize, value: u32) -> io::Result<()> {
        self.map.store_u32(offset, value)
    }

    /// Fails unless `[offset, offset + len)` lies inside the mapping.
    pub fn check_range(&self, offset: usize, len: usize) -> io::Result<()> {
        self.map.check_range(offset, len)
    }
}

/// The most bytes a copy involving hugepage memory moves per step through its buffer.
const HUGEPAGE_BOUNCE: usize = 64 << 10;

/// A failed [`SharedMemory::copy_to`]: the side it failed on, and why.
#[derive(Debug)]
pub enum CopyError {
    Source(io::Error),
    Target(io::Error),
}

/// A kernel copy that stopped early hit a page it could not fault in.
fn short_copy(done: usize, wanted: usize) -> io::Result<()> {
    if done == wanted {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(libc::EFAULT))
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // Give the pages back now, whoever still holds the file or a mapping of it. The
        // daemon's own mapping goes right after, with `map`.
        let len = libc::off_t::try_from(self.len()).unwrap_or(libc::off_t::MAX);
        if let Err(e) = nix::fcntl::fallocate(
            std::os::fd::AsRawFd::as_raw_fd(&self.fd()),
            nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
                | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
            0,
            len,
        ) {
            tracing::warn!(
                "releasing the pages of a {}-byte memfd failed: {e}",
                self.len()
            );
        }
    }
}

#[cfg(test)]
// `mincore` (is a page resident?) has no safe wrapper.
#[allow(unsafe_code)]
mod tests {
    use super::*;

    #[test]
    fn fresh_memory_is_zero_and_size_is_sealed() {
        let mem = SharedMemory::create(c"test", 8192).unwrap();
        let mut buf = vec![0xffu8; 8192];
        mem.read_at(0, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        assert!(
            nix::unistd::ftruncate(mem.fd(), 4096).is_err(),
            "shrink must be sealed"
        );
        assert!(
            nix::unistd::ftruncate(mem.fd(), 16384).is_err(),
            "grow must be sealed"
        );
        let raw = std::os::fd::AsRawFd::as_raw_fd(&mem.fd());
        assert!(
            fcntl(raw, FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_WRITE)).is_err(),
            "the seals themselves must be sealed"
        );
        let mode = nix::sys::stat::fstat(raw).unwrap().st_mode & 0o777;
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn ring_words_are_atomic_and_checked() {
        let mem = SharedMemory::create(c"test", 4096).unwrap();
        mem.store_u32(64, 7).unwrap();
        assert_eq!(mem.load_u32(64).unwrap(), 7);
        let mut raw = [0u8; 4];
        mem.read_at(64, &mut raw).unwrap();
        assert_eq!(u32::from_le_bytes(raw), 7);
        assert!(mem.load_u32(66).is_err(), "unaligned");
        assert!(mem.store_u32(4094, 1).is_err(), "out of range");
    }

    fn resident_pages(mem: &SharedMemory) -> usize {
        let pages = mem.len().div_ceil(4096);
        let mut vec = vec![0u8; pages];
        // SAFETY: the mapping is live and page aligned, `vec` has one byte per page.
        let rc = unsafe { libc::mincore(mem.as_ptr().cast(), mem.len(), vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", io::Error::last_os_error());
        vec.iter().filter(|&&b| b & 1 != 0).count()
    }

    /// A client that keeps the descriptor (and maps it again) after the daemon let go sees
    /// zeros, never the old contents, and holds no page the daemon faulted.
    #[test]
    fn dropping_returns_the_pages_whoever_keeps_the_file() {
        let mem = SharedMemory::create(c"test", 1 << 20).unwrap();
        mem.write_at(0, &vec![0x5a; 1 << 20]).unwrap();
        assert_eq!(resident_pages(&mem), 256);
        let kept = mem.fd().try_clone_to_owned().unwrap();
        drop(mem);
        let stat = nix::sys::stat::fstat(std::os::fd::AsRawFd::as_raw_fd(&kept)).unwrap();
        assert_eq!(stat.st_size, 1 << 20, "the size stays");
        assert_eq!(stat.st_blocks, 0, "no page is left allocated in the file");
        let again = rdmad_client::RegionMapping::map(kept, 1 << 20, true).unwrap();
        let mut buf = vec![0xffu8; 1 << 20];
        again.read(0, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0), "a stale mapping reads zeros");
    }

    /// A client punching holes in memory the daemon copies from makes those bytes read as
    /// zero; the daemon's copy does not fault.
    #[test]
    fn a_punched_hole_reads_as_zero() {
        let mem = SharedMemory::create(c"test", 8192).unwrap();
        mem.write_at(0, &[7u8; 8192]).unwrap();
        nix::fcntl::fallocate(
            std::os::fd::AsRawFd::as_raw_fd(&mem.fd()),
            nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
                | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
            0,
            4096,
        )
        .unwrap();
        let mut buf = [9u8; 8192];
        mem.read_at(0, &mut buf).unwrap();
        assert!(buf[..4096].iter().all(|&b| b == 0));
        assert!(buf[4096..].iter().all(|&b| b == 7));
    }

    #[test]
    fn out_of_range_access_is_refused() {
        let mem = SharedMemory::create(c"test", 4096).unwrap();
        mem.write_at(4090, b"abcdef").unwrap();
        assert!(mem.write_at(4091, b"abcdef").is_err());
        assert!(mem.read_at(usize::MAX, &mut [0u8; 2]).is_err());
        assert!(SharedMemory::create(c"empty", 0).is_err());
    }
}
