//! The two-sample chi-square test the sampled-output tests share: do the tokens committed with a
//! drafter follow the same distribution as plain sampling?

/// Two-sample chi-square statistic over the bins of `a` and `b` (equal sample sizes), merging
/// bins whose pooled count is below 10; returns (statistic, degrees of freedom).
pub fn chi_square(a: &[usize], b: &[usize]) -> (f64, usize) {
    let (mut stat, mut bins) = (0.0, 0usize);
    let (mut ra, mut rb) = (0usize, 0usize);
    for (&x, &y) in a.iter().zip(b) {
        if x + y >= 10 {
            let d = x as f64 - y as f64;
            stat += d * d / (x + y) as f64;
            bins += 1;
        } else {
            ra += x;
            rb += y;
        }
    }
    if ra + rb > 0 {
        let d = ra as f64 - rb as f64;
        stat += d * d / (ra + rb) as f64;
        bins += 1;
    }
    (stat, bins.saturating_sub(1))
}

/// Chi-square critical value at p = 0.001 (Wilson–Hilferty approximation).
pub fn critical(df: usize) -> f64 {
    let k = df as f64;
    let z = 3.090; // one-sided normal quantile at 0.999
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_samples_pass_and_different_ones_fail() {
        let a = [100, 200, 300, 400];
        let (stat, df) = chi_square(&a, &a);
        assert_eq!((stat, df), (0.0, 3));
        let b = [400, 300, 200, 100];
        let (stat, df) = chi_square(&a, &b);
        assert!(stat > critical(df), "{stat}");
        // Bins under 10 pooled merge into one.
        assert_eq!(chi_square(&[3, 2, 50], &[4, 1, 50]).1, 1);
        // Wilson–Hilferty is within 1% of the table value 16.27 (df 3, p 0.001).
        assert!((critical(3) - 16.27).abs() < 0.2, "{}", critical(3));
    }
}
