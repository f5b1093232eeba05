//! Page contents the bench can check: every 8-byte word is a function of the
//! page's GPA, a seed, and the word's index.

use rdma_transport::Page;

const STEP: u64 = 0xbf58_476d_1ce4_e5b9;

/// Word 0 of the page; word i is `base + i * STEP` (cheap to make and check,
/// and still different for every GPA, seed and position).
fn base(gpa: u64, seed: u64) -> u64 {
    (gpa ^ seed.rotate_left(17)).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
}

/// Word 0 of the pattern of (`gpa`, `seed`).
pub fn first_word(gpa: u64, seed: u64) -> u64 {
    base(gpa, seed)
}

/// Fills `page` with the pattern of (`gpa`, `seed`).
pub fn fill(page: &mut Page, gpa: u64, seed: u64) {
    let mut w = base(gpa, seed);
    for chunk in page.chunks_exact_mut(8) {
        chunk.copy_from_slice(&w.to_le_bytes());
        w = w.wrapping_add(STEP);
    }
}

/// True when `page` holds the pattern of (`gpa`, `seed`). Steps the
/// expected word by addition, as `fill` does (a multiply per word costs
/// twice as much on the host and ~4x under emulation, e.g. the SoftRoCE
/// VM's TCG, where this runs between every two timed operations).
pub fn check(page: &Page, gpa: u64, seed: u64) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: this CPU has AVX2 (checked just above).
        return unsafe { check_avx2(page, gpa, seed) };
    }
    check_words(page, gpa, seed)
}

/// [`check`] compiled for AVX2: four words per vector instead of SSE2's
/// two, half the instructions per page (the check runs between the
/// blocking batches of `--depth 16`, where nothing is in flight).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn check_avx2(page: &Page, gpa: u64, seed: u64) -> bool {
    check_words(page, gpa, seed)
}

#[inline(always)]
fn check_words(page: &Page, gpa: u64, seed: u64) -> bool {
    let mut w = base(gpa, seed);
    let mut diff = 0u64;
    for chunk in page.chunks_exact(8) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        diff |= u64::from_le_bytes(word) ^ w;
        w = w.wrapping_add(STEP);
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdma_transport::PAGE_SIZE;

    #[test]
    fn fill_then_check_and_detect_changes() {
        // The dispatching check (AVX2 where the CPU has it) and the plain one.
        type Check = fn(&Page, u64, u64) -> bool;
        let checks: [(&str, Check); 2] = [("check", check), ("check_words", check_words)];
        for (name, check) in checks {
            let mut page = [0u8; PAGE_SIZE];
            fill(&mut page, 0x5000, 7);
            assert!(check(&page, 0x5000, 7), "{name}");
            assert!(!check(&page, 0x6000, 7), "{name}: another GPA");
            assert!(!check(&page, 0x5000, 8), "{name}: another seed");
            for byte in [0, 8, 31, 32, 2047, 4064, 4095] {
                let mut bad = page;
                bad[byte] ^= 1;
                assert!(
                    !check(&bad, 0x5000, 7),
                    "{name}: bit 0 of byte {byte} flipped"
                );
            }
        }
    }
}
