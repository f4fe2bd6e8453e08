"""The notifier service: what people must hear about, sent to Slack, PagerDuty and signed webhooks."""
