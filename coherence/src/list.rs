//! A small fixed-capacity list: what a transition returns, without allocating.

/// Up to `N` items, in the order they were pushed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct List<T: Copy, const N: usize> {
    items: [Option<T>; N],
    len: usize,
}

impl<T: Copy, const N: usize> List<T, N> {
    /// An empty list.
    pub const fn new() -> Self {
        List {
            items: [None; N],
            len: 0,
        }
    }

    /// Appends `item`; `false` (and the item dropped) if the list is full.
    /// The protocol's transitions are written so that this never happens (see
    /// the capacity constants); the callers count it if it ever does.
    #[must_use]
    pub fn push(&mut self, item: T) -> bool {
        match self.items.get_mut(self.len) {
            Some(slot) => {
                *slot = Some(item);
                self.len += 1;
                true
            }
            None => false,
        }
    }

    /// How many items.
    pub const fn len(&self) -> usize {
        self.len
    }

    /// Whether there is no item.
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The items, first pushed first.
    pub fn iter(&self) -> impl Iterator<Item = T> + '_ {
        self.items[..self.len].iter().flatten().copied()
    }

    /// Keeps the items for which `keep` is true, in order.
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        let mut kept = 0;
        for i in 0..self.len {
            if let Some(item) = self.items[i] {
                if keep(&item) {
                    self.items[kept] = Some(item);
                    kept += 1;
                }
            }
        }
        for slot in &mut self.items[kept..self.len] {
            *slot = None;
        }
        self.len = kept;
    }

    /// Removes and returns the first item.
    pub fn pop_front(&mut self) -> Option<T> {
        let first = self.items[..self.len].first().copied().flatten()?;
        self.items[..self.len].rotate_left(1);
        self.len -= 1;
        self.items[self.len] = None;
        Some(first)
    }

    /// The first item for which `pred` is true, mutably.
    pub fn find_mut(&mut self, mut pred: impl FnMut(&T) -> bool) -> Option<&mut T> {
        self.items[..self.len]
            .iter_mut()
            .flatten()
            .find(|item| pred(item))
    }
}

impl<T: Copy, const N: usize> Default for List<T, N> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::List;

    #[test]
    fn push_until_full_then_refuse() {
        let mut list: List<u8, 2> = List::new();
        assert!(list.push(1));
        assert!(list.push(2));
        assert!(!list.push(3));
        assert_eq!(list.iter().collect::<Vec<_>>(), vec![1, 2]);
    }

    #[test]
    fn pop_front_and_retain_keep_order() {
        let mut list: List<u8, 4> = List::new();
        for i in 1..=4 {
            assert!(list.push(i));
        }
        assert_eq!(list.pop_front(), Some(1));
        list.retain(|&x| x != 3);
        assert_eq!(list.iter().collect::<Vec<_>>(), vec![2, 4]);
        assert!(list.push(5));
        assert_eq!(list.iter().collect::<Vec<_>>(), vec![2, 4, 5]);
        if let Some(x) = list.find_mut(|&x| x == 4) {
            *x = 40;
        }
        assert_eq!(list.iter().collect::<Vec<_>>(), vec![2, 40, 5]);
        assert_eq!(list.len(), 3);
    }
}
