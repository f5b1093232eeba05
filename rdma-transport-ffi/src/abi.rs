//! Structs that cross the boundary with a `struct_size`: configs the C
//! caller fills (read here) and statistics the library fills (written
//! here), and 0/1 flags, all checked before any other field is looked at.
//!
//! Rule: every such struct starts with `uint32_t struct_size`, which the
//! caller sets to `sizeof` the struct (the `..._config_default` functions
//! do it for configs). The library accepts the sizes of the layouts it
//! knows: the one in its header and the older ones it grew from (a later
//! layout only appends fields). A config of an older layout gets defaults
//! for the missing tail; a statistics struct of an older layout is filled
//! as far as it reaches. A size the library does not know (e.g. a program
//! built against a newer header) is refused with `RT_STATUS_STRUCT_SIZE`
//! and nothing past `struct_size` is read or written.

use std::mem::size_of;

use crate::status::{fail, RtStatus};

/// A config struct of the C API: `#[repr(C)]`, `struct_size` first, every
/// field valid for any bytes (integers, pointers, optional functions).
pub(crate) trait CConfig: Copy {
    /// The C name, for messages.
    const NAME: &'static str;
    /// `struct_size` of earlier layouts still accepted: a prefix of this
    /// one, each ending where a later field starts (checked by a const
    /// assertion next to the struct). The fields past it take their
    /// defaults.
    const OLD_SIZES: &'static [usize] = &[];
    /// What the `..._config_default` function fills in.
    fn defaults() -> Self;
}

/// A struct the library fills for the caller (statistics): `#[repr(C)]`,
/// `struct_size` first (set by the caller to `sizeof` the struct), every
/// field an integer.
pub(crate) trait COut: Copy {
    /// The C name, for messages.
    const NAME: &'static str;
    /// `struct_size` of earlier layouts still filled (their prefix only).
    const OLD_SIZES: &'static [usize] = &[];
}

/// The `struct_size` at `ptr`, if it is the size of `T` or of one of its
/// `old` layouts; else the status, recorded for `rt_last_error`.
///
/// # Safety
/// `ptr` must be NULL or point to at least 4 readable bytes, 4-byte aligned.
unsafe fn known_size<T>(ptr: *const T, name: &str, old: &[usize]) -> Result<usize, RtStatus> {
    if ptr.is_null() {
        return Err(fail(RtStatus::InvalidArgument, format!("{name} is NULL")));
    }
    // SAFETY: non-null, and every layout starts with a `u32` (caller's
    // contract); the struct is at least 4-byte aligned.
    let struct_size = unsafe { ptr.cast::<u32>().read() } as usize;
    let known = size_of::<T>();
    if struct_size == known || old.contains(&struct_size) {
        return Ok(struct_size);
    }
    Err(fail(
        RtStatus::StructSize,
        format!(
            "{name}.struct_size is {struct_size}; this library knows {known}{}: set it to \
             sizeof({name}) and build against the header of this library",
            old.iter().map(|s| format!(" or {s}")).collect::<String>()
        ),
    ))
}

/// Copies the config at `ptr` after checking its `struct_size`: this
/// layout, or an older one whose missing fields take their defaults. On
/// error, the status is recorded for `rt_last_error`.
///
/// # Safety
/// `ptr` must be NULL or point to at least `struct_size` readable bytes
/// whose first four are `struct_size`.
pub(crate) unsafe fn read_config<T: CConfig>(ptr: *const T) -> Result<T, RtStatus> {
    // SAFETY: the caller's contract.
    let struct_size = unsafe { known_size(ptr, T::NAME, T::OLD_SIZES) }?;
    if struct_size == size_of::<T>() {
        // SAFETY: `struct_size` says the caller's struct is this layout, and
        // every field of `T` is valid for any bytes (`CConfig`).
        return Ok(unsafe { ptr.read() });
    }
    let mut value = T::defaults();
    // SAFETY: the caller's struct has `struct_size` readable bytes, fewer
    // than `size_of::<T>()` (an old layout), which `value` can hold; an old
    // layout is a prefix of this one ending at a field boundary, and every
    // field is valid for any bytes (`CConfig`).
    unsafe {
        std::ptr::copy_nonoverlapping(
            ptr.cast::<u8>(),
            std::ptr::from_mut(&mut value).cast::<u8>(),
            struct_size,
        );
    }
    Ok(value)
}

/// Fills the caller's struct at `ptr` with `value`, as far as its
/// `struct_size` (this layout or an older one) reaches; `struct_size`
/// itself is left alone. On error, the status is recorded for
/// `rt_last_error` and nothing is written.
///
/// # Safety
/// `ptr` must be NULL or point to at least `struct_size` writable bytes
/// whose first four are `struct_size`.
pub(crate) unsafe fn write_out<T: COut>(ptr: *mut T, value: &T) -> Result<(), RtStatus> {
    // SAFETY: the caller's contract.
    let struct_size = unsafe { known_size(ptr.cast_const(), T::NAME, T::OLD_SIZES) }?;
    // Past the leading `struct_size` (the caller's stays).
    let skip = size_of::<u32>();
    let from = std::ptr::from_ref(value).cast::<u8>().wrapping_add(skip);
    let to = ptr.cast::<u8>().wrapping_add(skip);
    // SAFETY: the caller's struct has `struct_size` writable bytes (at
    // most `size_of::<T>()`, which `value` has), so both ranges of
    // `struct_size - skip` bytes after `skip` are in bounds; every field is
    // an integer (`COut`).
    unsafe { std::ptr::copy_nonoverlapping(from, to, struct_size - skip) };
    Ok(())
}

/// A C flag: 0 is false, 1 is true, anything else is refused.
pub(crate) fn flag(value: u32, struct_name: &str, field: &str) -> Result<bool, RtStatus> {
    match value {
        0 => Ok(false),
        1 => Ok(true),
        other => Err(fail(
            RtStatus::InvalidArgument,
            format!("{struct_name}.{field} must be 0 or 1, not {other}"),
        )),
    }
}

/// `sizeof(T)` as the `struct_size` of a default config.
pub(crate) fn struct_size<T>() -> u32 {
    size_of::<T>() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A struct of three layouts: 8 bytes (`a`), 16 (`a`, `b`), 24 (all).
    #[repr(C)]
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct Grown {
        struct_size: u32,
        a: u32,
        b: u64,
        c: u64,
    }

    impl CConfig for Grown {
        const NAME: &'static str = "Grown";
        const OLD_SIZES: &'static [usize] = &[8, 16];
        fn defaults() -> Self {
            Self {
                struct_size: 24,
                a: 1,
                b: 2,
                c: 3,
            }
        }
    }

    impl COut for Grown {
        const NAME: &'static str = "Grown";
        const OLD_SIZES: &'static [usize] = &[8, 16];
    }

    #[test]
    fn an_old_config_layout_gets_defaults_for_its_missing_tail() {
        let caller = Grown {
            struct_size: 16,
            a: 10,
            b: 20,
            c: 30,
        };
        // SAFETY: a live struct of 24 >= 16 bytes.
        let read = unsafe { read_config(&caller) }.unwrap();
        assert_eq!((read.a, read.b, read.c), (10, 20, 3));
        let caller = Grown {
            struct_size: 24,
            ..caller
        };
        // SAFETY: as above.
        let read = unsafe { read_config(&caller) }.unwrap();
        assert_eq!((read.a, read.b, read.c), (10, 20, 30));
        for size in [0, 4, 12, 32] {
            let caller = Grown {
                struct_size: size,
                ..caller
            };
            // SAFETY: as above.
            let err = unsafe { read_config(&caller) }.unwrap_err();
            assert_eq!(err, RtStatus::StructSize, "struct_size {size}");
        }
    }

    #[test]
    fn an_old_out_layout_is_filled_as_far_as_it_reaches() {
        let value = Grown {
            struct_size: 0,
            a: 10,
            b: 20,
            c: 30,
        };
        let mut out = Grown {
            struct_size: 8,
            a: 0,
            b: 0,
            c: 0,
        };
        // SAFETY: a live struct of 24 >= 8 writable bytes.
        unsafe { write_out(&mut out, &value) }.unwrap();
        assert_eq!(
            out,
            Grown {
                struct_size: 8,
                a: 10,
                b: 0,
                c: 0
            }
        );
        out.struct_size = 24;
        // SAFETY: as above.
        unsafe { write_out(&mut out, &value) }.unwrap();
        assert_eq!(
            out,
            Grown {
                struct_size: 24,
                ..value
            }
        );
        let mut out = Grown {
            struct_size: 20,
            a: 0,
            b: 0,
            c: 0,
        };
        // SAFETY: as above.
        let err = unsafe { write_out(&mut out, &value) }.unwrap_err();
        assert_eq!((err, out.a), (RtStatus::StructSize, 0));
    }
}
