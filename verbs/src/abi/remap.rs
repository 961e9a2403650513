//! Moving a new mapping under a running program's pages, contents kept, without losing a
//! write: how `ibv_reg_mr` puts rdmad's memory under a buffer and `ibv_dereg_mr` puts
//! private memory back.
//!
//! The pages are made read-only for the moment of the move (a *window*): their contents
//! are copied into the new mapping and the new mapping replaces them in one `mremap`.
//! Another thread that writes to them in the window — to the buffer, or to anything else
//! on the same pages, such as a neighbouring heap object or the library's own bus thread's
//! state — faults, waits in this module's `SIGSEGV` handler until the window closes and
//! then repeats its write, which lands in the new mapping. Faults anywhere else go to the
//! handler the program had. The handler stays installed after the window: a thread whose
//! write faulted in the window may take the signal only after the window closed (the
//! kernel picks the handler when it delivers the signal, not when the write faults), and
//! the program's own action — the default one kills — must not get it then; such a late
//! fault is repeated too, a bounded number of times per window, and the program's action
//! gets whatever still faults after that. The calling thread itself cannot write in the window (its
//! signals are blocked and the three system calls are issued back to back from registers),
//! so even a range on its own stack is copied exactly as it is at the move. The library's
//! own bus thread is parked meanwhile: a write by the kernel (a socket read, `epoll_wait`'s
//! events) into pages made read-only fails with `EFAULT` instead of waiting.

use std::cell::UnsafeCell;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use super::registry::lock;

/// One window at a time: the handler knows one range.
static WINDOW: Mutex<()> = Mutex::new(());
static WINDOW_START: AtomicUsize = AtomicUsize::new(0);
static WINDOW_END: AtomicUsize = AtomicUsize::new(0);
static WINDOW_OPEN: AtomicBool = AtomicBool::new(false);
/// Faults in the last window's range since it closed, repeated on the chance that they
/// were the window's own, delivered late (reset when a window opens).
static LATE_FAULTS: AtomicUsize = AtomicUsize::new(0);
/// How many such faults are repeated before they go to the program's action: a late
/// window fault succeeds when repeated once, a real one (the program wrote to memory it
/// made read-only since) faults every time.
const LATE_FAULT_RETRIES: usize = 1024;

/// The program's own `SIGSEGV` action while ours stands in for it: written under
/// [`WINDOW`] before ours is installed, read by the handler for faults not ours.
struct Previous(UnsafeCell<Option<libc::sigaction>>);
// SAFETY: written only under WINDOW while no handler of ours is installed that could read
// it for a window being opened (see `open_window`); read-only otherwise.
unsafe impl Sync for Previous {}
static PREVIOUS: Previous = Previous(UnsafeCell::new(None));

/// Copies `[start, start+len)` into `temp` (a fresh mapping of `len` bytes this library
/// made) and moves `temp` over the range, which then has protection `prot` — the range's
/// protection now. Other threads' writes to the range in between wait and then land in the
/// new mapping (module docs). On failure the range is as it was and `temp` is unmapped.
///
/// # Safety
/// `temp` must be a mapping of `len` bytes this library made and nobody else uses; the
/// range must be the program's own memory, of protection `prot` (checked against
/// `/proc/self/maps` by the caller).
pub unsafe fn copy_and_move(
    temp: *mut c_void,
    start: usize,
    len: usize,
    prot: c_int,
) -> std::io::Result<()> {
    let args = MoveArgs {
        // SAFETY: getpid has no preconditions.
        pid: unsafe { libc::getpid() } as usize,
        local: libc::iovec {
            iov_base: temp,
            iov_len: len,
        },
        remote: libc::iovec {
            iov_base: start as *mut c_void,
            iov_len: len,
        },
        temp: temp as usize,
        start,
        len,
        read_only: (libc::PROT_READ | (prot & libc::PROT_EXEC)) as usize,
        prot: prot as usize,
    };
    let window = || {
        let _window = open_window(start, len);
        raw_copy_and_move(&args)
    };
    // The library's own bus thread makes no system call in the window (it could write into
    // the pages from the kernel, which fails on a read-only page rather than waits).
    let (ret, moved) = match crate::backend::backend() {
        Ok(backend) => backend.with_bus_thread_parked(window),
        Err(_) => window(),
    };
    if !moved || ret < 0 {
        // SAFETY: the move did not happen (or failed): `temp` is still ours to unmap.
        unsafe { libc::munmap(temp, len) };
        return Err(if ret < 0 {
            std::io::Error::from_raw_os_error(-ret as i32)
        } else {
            std::io::Error::from_raw_os_error(libc::EFAULT)
        });
    }
    if prot != libc::PROT_READ | libc::PROT_WRITE {
        // SAFETY: the range is now the mapping just moved there.
        unsafe { libc::mprotect(start as *mut c_void, len, prot) };
    }
    Ok(())
}

/// What the system calls of a move need, read by the assembly through one pointer.
#[repr(C)]
struct MoveArgs {
    pid: usize,
    local: libc::iovec,
    remote: libc::iovec,
    temp: usize,
    start: usize,
    len: usize,
    /// The range's protection in the window.
    read_only: usize,
    /// The range's protection before the window (restored if the move fails).
    prot: usize,
}

/// An open window: the handler is ours and the calling thread's signals are blocked until
/// it is dropped.
struct Window {
    _serial: std::sync::MutexGuard<'static, ()>,
    mask: libc::sigset_t,
}

fn open_window(start: usize, len: usize) -> Window {
    let serial = lock(&WINDOW);
    WINDOW_START.store(start, Ordering::Release);
    WINDOW_END.store(start + len, Ordering::Release);
    LATE_FAULTS.store(0, Ordering::Release);
    WINDOW_OPEN.store(true, Ordering::Release);
    // SAFETY: sigaction reads `ours` and writes the current action into `current`, both
    // valid; PREVIOUS is written under WINDOW, before our handler is installed.
    unsafe {
        let mut current: libc::sigaction = std::mem::zeroed();
        libc::sigaction(libc::SIGSEGV, std::ptr::null(), &mut current);
        if current.sa_sigaction != on_fault as *const () as usize {
            *PREVIOUS.0.get() = Some(current);
        }
        let mut ours: libc::sigaction = std::mem::zeroed();
        ours.sa_sigaction = on_fault as *const () as usize;
        ours.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESTART;
        libc::sigemptyset(&mut ours.sa_mask);
        libc::sigaction(libc::SIGSEGV, &ours, std::ptr::null_mut());
    }
    // No signal handler may run on this thread in the window: it could write to the range
    // (its frame, if the range is this thread's stack) and then wait for itself.
    // SAFETY: pthread_sigmask with a full set and a valid out-pointer for the old mask.
    let mask = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        old
    };
    Window {
        _serial: serial,
        mask,
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        // Threads waiting in the handler repeat their writes now; the range stays the
        // window's and the handler stays installed, so one whose fault is delivered only
        // after this still repeats its write (module docs).
        WINDOW_OPEN.store(false, Ordering::Release);
        // SAFETY: restores this thread's mask, saved by `open_window`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.mask, std::ptr::null_mut()) };
    }
}

/// The `SIGSEGV` handler from the first window on. A fault in the window's range is a
/// write to pages being moved: wait for the move, then return so the write is made again;
/// after the window, a fault there is repeated up to [`LATE_FAULT_RETRIES`] times (a late
/// delivery of one from the window). Any other fault is the program's: its own action
/// decides.
extern "C" fn on_fault(sig: c_int, info: *mut libc::siginfo_t, context: *mut c_void) {
    // SAFETY: the kernel passes SA_SIGINFO handlers a valid siginfo; for SIGSEGV si_addr
    // is the faulting address.
    let addr = unsafe { (*info).si_addr() } as usize;
    if WINDOW_START.load(Ordering::Acquire) <= addr && addr < WINDOW_END.load(Ordering::Acquire) {
        if WINDOW_OPEN.load(Ordering::Acquire) {
            while WINDOW_OPEN.load(Ordering::Acquire) {
                // SAFETY: sched_yield has no preconditions (a system call, signal-safe).
                unsafe { libc::sched_yield() };
            }
            return;
        }
        if LATE_FAULTS.fetch_add(1, Ordering::AcqRel) < LATE_FAULT_RETRIES {
            return;
        }
    }
    // SAFETY: PREVIOUS holds the action the program had when the window opened (always
    // set before this handler is installed); calling it as its flags say is what the
    // kernel would have done.
    unsafe {
        match &*PREVIOUS.0.get() {
            Some(previous)
                if previous.sa_sigaction != libc::SIG_DFL
                    && previous.sa_sigaction != libc::SIG_IGN =>
            {
                if previous.sa_flags & libc::SA_SIGINFO != 0 {
                    let handler: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) =
                        std::mem::transmute(previous.sa_sigaction);
                    handler(sig, info, context);
                } else {
                    let handler: extern "C" fn(c_int) = std::mem::transmute(previous.sa_sigaction);
                    handler(sig);
                }
            }
            // The default action (a fault is never ignored): restore it and return; the
            // faulting instruction faults again and the kernel takes it.
            _ => {
                let mut default: libc::sigaction = std::mem::zeroed();
                default.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(sig, &default, std::ptr::null_mut());
            }
        }
    }
}

/// The window's system calls: `mprotect` the range read-only, `process_vm_readv` it into
/// `temp` (which fails rather than faults on unreadable memory) and, if all of it was
/// copied, `mremap` `temp` over it; a failed copy or move restores the protection. Returns
/// the last call's result (−errno on failure) and whether the move was attempted.
#[cfg(target_arch = "x86_64")]
fn raw_copy_and_move(args: &MoveArgs) -> (isize, bool) {
    let ret: isize;
    let moved: usize;
    // SAFETY: the calls are mprotect(start, len, read_only); process_vm_readv(pid, &local,
    // 1, &remote, 1, 0), reading this process's memory into `temp` through the kernel;
    // mremap(temp, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, start), moving the caller's
    // fresh mapping over the range the caller checked; and on failure mprotect(start, len,
    // prot). Their arguments are read from `args` (valid for the block, only read); nothing
    // touches the user stack; `syscall` clobbers rcx and r11.
    unsafe {
        std::arch::asm!(
            "mov eax, {mprotect}",
            "mov rdi, [r12 + {start}]",
            "mov rsi, [r12 + {len}]",
            "mov rdx, [r12 + {read_only}]",
            "syscall",
            "test rax, rax",
            "jnz 9f",
            "mov eax, {readv}",
            "mov rdi, [r12 + {pid}]",
            "lea rsi, [r12 + {local}]",
            "mov edx, 1",
            "lea r10, [r12 + {remote}]",
            "mov r8d, 1",
            "xor r9d, r9d",
            "syscall",
            "cmp rax, [r12 + {len}]",
            "jne 8f",
            "mov eax, {mremap}",
            "mov rdi, [r12 + {temp}]",
            "mov rsi, [r12 + {len}]",
            "mov rdx, rsi",
            "mov r10d, {flags}",
            "mov r8, [r12 + {start}]",
            "syscall",
            "mov r15d, 1",
            "cmp rax, -4095",
            "jb 9f",
            "8:",
            "mov r13, rax",
            "mov eax, {mprotect}",
            "mov rdi, [r12 + {start}]",
            "mov rsi, [r12 + {len}]",
            "mov rdx, [r12 + {prot}]",
            "syscall",
            "mov rax, r13",
            "9:",
            mprotect = const libc::SYS_mprotect,
            readv = const libc::SYS_process_vm_readv,
            mremap = const libc::SYS_mremap,
            flags = const libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            pid = const std::mem::offset_of!(MoveArgs, pid),
            local = const std::mem::offset_of!(MoveArgs, local),
            remote = const std::mem::offset_of!(MoveArgs, remote),
            temp = const std::mem::offset_of!(MoveArgs, temp),
            start = const std::mem::offset_of!(MoveArgs, start),
            len = const std::mem::offset_of!(MoveArgs, len),
            read_only = const std::mem::offset_of!(MoveArgs, read_only),
            prot = const std::mem::offset_of!(MoveArgs, prot),
            in("r12") args as *const MoveArgs,
            out("rax") ret,
            out("rdi") _,
            out("rsi") _,
            out("rdx") _,
            out("r10") _,
            out("r8") _,
            out("r9") _,
            out("r13") _,
            inout("r15") 0usize => moved,
            out("rcx") _,
            out("r11") _,
            options(nostack),
        );
    }
    // mremap's success is the range's address; the failures are −errno.
    (if moved == 1 && ret >= 0 { 0 } else { ret }, moved == 1)
}

/// Elsewhere the calls are made from Rust: a range on the calling thread's own stack may
/// then lose the writes of the frames in between (other threads' writes still wait).
#[cfg(not(target_arch = "x86_64"))]
fn raw_copy_and_move(args: &MoveArgs) -> (isize, bool) {
    let errno = || {
        -(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EFAULT)) as isize
    };
    // SAFETY: as in the x86_64 version, from Rust.
    unsafe {
        let start = args.start as *mut c_void;
        if libc::mprotect(start, args.len, args.read_only as c_int) != 0 {
            return (errno(), false);
        }
        let n = libc::process_vm_readv(args.pid as libc::pid_t, &args.local, 1, &args.remote, 1, 0);
        if n != args.len as isize {
            let ret = if n < 0 { errno() } else { n };
            libc::mprotect(start, args.len, args.prot as c_int);
            return (ret, false);
        }
        let r = libc::mremap(
            args.temp as *mut c_void,
            args.len,
            args.len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            start,
        );
        if r == libc::MAP_FAILED {
            let ret = errno();
            libc::mprotect(start, args.len, args.prot as c_int);
            (ret, true)
        } else {
            (0, true)
        }
    }
}
