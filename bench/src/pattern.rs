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
        let mut page = [0u8; PAGE_SIZE];
        fill(&mut page, 0x5000, 7);
        assert!(check(&page, 0x5000, 7));
        assert!(!check(&page, 0x6000, 7), "another GPA");
        assert!(!check(&page, 0x5000, 8), "another seed");
        page[4095] ^= 1;
        assert!(!check(&page, 0x5000, 7), "one flipped bit");
    }
}
