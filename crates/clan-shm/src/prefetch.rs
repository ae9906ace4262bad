//! Cache prefetch hints: bring lines that an access is about to touch into the cache
//! together, so that their misses overlap instead of following one another (at thousands of
//! connections used at random, every line of a connection's state is a miss).

/// Ask the CPU to bring the cache line holding `p` towards this core. A hint: it never
/// faults (any address is accepted, mapped or not) and changes nothing a program can see.
#[inline(always)]
pub fn line<T: ?Sized>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `prefetcht0` is part of SSE, which every x86-64 CPU has (the target's
    // baseline), and it never faults nor writes: any address is valid for it.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// [`line()`] for every cache line of `len` bytes from `p`.
#[inline(always)]
pub fn range<T: ?Sized>(p: *const T, len: usize) {
    for a in lines(p.cast::<u8>() as usize, len) {
        line(a as *const u8);
    }
}

/// The address of every 64-byte line that `[start, start+len)` touches (none when `len` is
/// 0; up to the end of the address space at most).
#[inline(always)]
fn lines(start: usize, len: usize) -> impl Iterator<Item = usize> {
    let end = if len == 0 { start & !63 } else { start.saturating_add(len) };
    (start & !63..end).step_by(64)
}

/// [`range`] over the bytes of `v`.
#[inline(always)]
pub fn value<T>(v: &T) {
    range(v as *const T, std::mem::size_of::<T>());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hint_at_any_address_never_faults() {
        // Null, unmapped, kernel and misaligned addresses: a prefetch is only a hint (a
        // fault here would kill the test).
        for a in [0usize, 1, 4095, 0x10, 0xdead_beef, usize::MAX - 63, 0xffff_8000_0000_0000] {
            line(a as *const u8);
            range(a as *const u8, 300);
        }
        let v = vec![7u8; 1000];
        range(v.as_ptr(), v.len());
        value(&v);
        assert!(v.iter().all(|&b| b == 7), "a prefetch changes nothing");
    }

    #[test]
    fn a_range_asks_for_every_line_it_covers() {
        let l = |start: usize, len: usize| lines(start, len).collect::<Vec<_>>();
        assert_eq!(l(0, 64), [0]);
        assert_eq!(l(63, 2), [0, 64]);
        assert_eq!(l(128, 129), [128, 192, 256]);
        assert_eq!(l(100, 0), [] as [usize; 0]);
        assert_eq!(l(usize::MAX - 10, 300), [usize::MAX & !63], "no wrap past the end");
    }
}
