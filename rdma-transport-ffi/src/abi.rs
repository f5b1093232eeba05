//! Reading config structs that C callers fill: the `struct_size` rule and
//! 0/1 flags, checked before any other field is looked at.
//!
//! Rule: every config struct starts with `uint32_t struct_size`, which the
//! caller sets to `sizeof` the struct (the `..._config_default` functions
//! do). The library accepts the sizes of layouts it knows: today only the
//! one in this header. A later version appends fields and still accepts
//! this size (with defaults for the missing tail); a size the library does
//! not know (e.g. a program built against a newer header) is refused with
//! `RT_STATUS_STRUCT_SIZE` and nothing past `struct_size` is read.

use std::mem::size_of;

use crate::status::{fail, RtStatus};

/// A config struct of the C API: `#[repr(C)]`, `struct_size` first, every
/// field valid for any bytes (integers, pointers, optional functions).
pub(crate) trait CConfig: Copy {
    /// The C name, for messages.
    const NAME: &'static str;
}

/// Copies the config at `ptr` after checking its `struct_size`. On error,
/// the status is recorded for `rt_last_error`.
///
/// # Safety
/// `ptr` must be NULL or point to at least `struct_size` readable bytes
/// whose first four are `struct_size`.
pub(crate) unsafe fn read_config<T: CConfig>(ptr: *const T) -> Result<T, RtStatus> {
    if ptr.is_null() {
        return Err(fail(
            RtStatus::InvalidArgument,
            format!("{} is NULL", T::NAME),
        ));
    }
    // SAFETY: non-null, and every layout starts with a `u32` (caller's
    // contract); the struct is at least 4-byte aligned.
    let struct_size = unsafe { ptr.cast::<u32>().read() };
    let known = size_of::<T>();
    if struct_size as usize != known {
        return Err(fail(
            RtStatus::StructSize,
            format!(
                "{}.struct_size is {struct_size}; this library knows {known}: set it to \
                 sizeof({}) (the _config_default function does) and build against the \
                 header of this library",
                T::NAME,
                T::NAME
            ),
        ));
    }
    // SAFETY: `struct_size` says the caller's struct is this layout, and
    // every field of `T` is valid for any bytes (`CConfig`).
    Ok(unsafe { ptr.read() })
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
pub(crate) fn struct_size<T: CConfig>() -> u32 {
    size_of::<T>() as u32
}
